/* A preloadable library that announces itself when loaded and interposes puts(), so a
 * test sees both that it was loaded and whether it comes first in symbol lookup. Built
 * twice by the tests: as a stand-in shim and as an image's own /etc/ld.so.preload
 * entry. */
#include <string.h>
#include <unistd.h>

#ifndef TAG
#error "build with -DTAG='\"name\"'"
#endif

static void say(const char *a, const char *b) {
    (void)!write(1, a, strlen(a));
    (void)!write(1, b, strlen(b));
    (void)!write(1, "\n", 1);
}

__attribute__((constructor)) static void announce(void) { say("LOADED:", TAG); }

int puts(const char *s) {
    say(TAG " says: ", s);
    return 1;
}
