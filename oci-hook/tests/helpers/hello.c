/* A dynamically linked program: ld.so reads /etc/ld.so.preload before running it. */
#include <stdio.h>

int main(void) {
    puts("HELLO-FROM-DYNAMIC-PROGRAM");
    return 0;
}
