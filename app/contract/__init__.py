"""The node's internal contract: every message between fronts, the supervisor and workers
(`messages`), the frames that carry them (`frames`), and the domain errors of the invoke path
(`errors`), which only the HTTP routers map to statuses."""
