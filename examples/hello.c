/* Example guest (C): greets the caller, shows the environment the platform gives a guest.
 * Build: python3 -m ziglang cc -target wasm32-wasi -O2 -s examples/hello.c -o hello.wasm
 * What a guest sees (argv, environment, exit status): docs/guest-abi.md, section 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    char body[4096];
    size_t n = fread(body, 1, sizeof body - 1, stdin);
    body[n] = 0;
    const char *names[] = {"TW_FUNCTION", "TW_INVOCATION_ID", "TW_TENANT", "QUERY_STRING", "CONTENT_TYPE", "GREETING"};
    printf("argv0=%s\n", argc > 0 ? argv[0] : "");
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *v = getenv(names[i]);
        printf("%s=%s\n", names[i], v ? v : "");
    }
    printf("body=%s\n", body);
    if (strcmp(body, "fail") == 0) {
        fprintf(stderr, "asked to fail\n");
        return 7;
    }
    return 0;
}
