/* A guest that reports what WASI gives it, and tries what a test asks of the file system.
 *
 *   (no arguments) | env ...  argv and the whole environment, one per line, \ and newlines escaped
 *   cat PATH                  the file's bytes
 *   ls PATH                   the directory's entries, sorted by the host's order, one per line
 *   write PATH N              write N bytes ('x', 64 KiB at a time) to a new file; "wrote N" or
 *                             "error after K: <errno name>"
 *   mkdir PATH | rm PATH      make a directory | remove a file
 *   symlink TARGET PATH       make a symbolic link
 *   linkcat TARGET PATH       make a symbolic link, then cat through it
 *
 * A failure prints "error: <errno name>" and exits 1.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

extern char **environ;

static void escaped(const char *s) {
    for (; *s; s++) {
        if (*s == '\\') fputs("\\\\", stdout);
        else if (*s == '\n') fputs("\\n", stdout);
        else putchar(*s);
    }
    putchar('\n');
}

static const char *name_of(int e) {
    switch (e) {
    case ENOENT: return "ENOENT";
    case EACCES: return "EACCES";
    case EPERM: return "EPERM";
    case ENOSPC: return "ENOSPC";
    case EROFS: return "EROFS";
    case EBADF: return "EBADF";
    case ENOTCAPABLE: return "ENOTCAPABLE";
    case EEXIST: return "EEXIST";
    case ELOOP: return "ELOOP";
    case EISDIR: return "EISDIR";
    case ENOTDIR: return "ENOTDIR";
    default: return "EOTHER";
    }
}

static int fail(void) {
    printf("error: %s\n", name_of(errno));
    return 1;
}

int main(int argc, char **argv) {
    const char *cmd = argc > 1 ? argv[1] : "env";
    if (strcmp(cmd, "env") == 0) {
        printf("argc=%d\n", argc);
        for (int i = 0; i < argc; i++) {
            printf("arg=");
            escaped(argv[i]);
        }
        for (char **e = environ; *e; e++) {
            printf("env=");
            escaped(*e);
        }
        return 0;
    }
    if (argc < 3) return 2;
    const char *path = argv[2];
    if (strcmp(cmd, "cat") == 0) {
        FILE *f = fopen(path, "rb");
        if (!f) return fail();
        char buf[4096];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, n, stdout);
        fclose(f);
        return 0;
    }
    if (strcmp(cmd, "ls") == 0) {
        DIR *d = opendir(path);
        if (!d) return fail();
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) printf("%s\n", e->d_name);
        }
        closedir(d);
        return 0;
    }
    if (strcmp(cmd, "write") == 0 && argc > 3) {
        long want = atol(argv[3]), done = 0;
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) return fail();
        static char chunk[65536];
        memset(chunk, 'x', sizeof chunk);
        while (done < want) {
            long n = want - done < (long)sizeof chunk ? want - done : (long)sizeof chunk;
            ssize_t w = write(fd, chunk, (size_t)n);
            if (w < 0) {
                printf("error after %ld: %s\n", done, name_of(errno));
                return 1;
            }
            done += w;
        }
        if (close(fd) != 0) return fail();
        printf("wrote %ld\n", done);
        return 0;
    }
    if (strcmp(cmd, "mkdir") == 0) return mkdir(path, 0755) == 0 ? (puts("ok"), 0) : fail();
    if (strcmp(cmd, "rm") == 0) return unlink(path) == 0 ? (puts("ok"), 0) : fail();
    if (strcmp(cmd, "symlink") == 0 && argc > 3) return symlink(argv[2], argv[3]) == 0 ? (puts("ok"), 0) : fail();
    if (strcmp(cmd, "linkcat") == 0 && argc > 3) {
        if (symlink(argv[2], argv[3]) != 0) return fail();
        char *cat[] = {argv[0], "cat", argv[3], NULL};
        return main(3, cat);
    }
    return 2;
}
