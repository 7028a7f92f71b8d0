"""Every query of the platform, and every tenant-scoping rule, lives in these repositories."""
