/* Connects to a Unix stream socket, sends "hello from <argv[2]>\n" and prints what the
 * peer answers. Built statically by the tests so it runs inside a busybox container,
 * whose nc has no Unix-socket support. */
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: uconnect SOCKET TAG\n");
        return 2;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    strncpy(a.sun_path, argv[1], sizeof a.sun_path - 1);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        perror("connect");
        return 1;
    }
    char msg[256];
    snprintf(msg, sizeof msg, "hello from %s\n", argv[2]);
    if (write(fd, msg, strlen(msg)) < 0) {
        perror("write");
        return 1;
    }
    char buf[256];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    if (n < 0) {
        perror("read");
        return 1;
    }
    buf[n] = 0;
    printf("UCONNECT-REPLY:%s", buf);
    return 0;
}
