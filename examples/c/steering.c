// SPDX-License-Identifier: Apache-2.0
/* The C API sample (docs/reuseportlb.md): joins two members of a SO_REUSEPORT group on
 * 127.0.0.1:PORT with source-IP steering, sends 2 datagrams from each of 20 loopback sources,
 * checks each arrived at the member reuseportlb_owner names, exercises the errors, withdraws
 * one member and checks every source then reaches the other, then checks five-tuple steering.
 * Build: cc -o steering steering.c $(pkg-config --cflags --libs reuseportlb)
 * Run:   ./steering PORT   (prints "received=40 misplaced=0 selected=40 steering=ebpf") */
#include <reuseportlb.h>
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 2 || atoi(argv[1]) <= 0 || atoi(argv[1]) > 65535) {
        fprintf(stderr, "usage: %s PORT (a free UDP port on 127.0.0.1)\n", argv[0]);
        return 2;
    }
    uint16_t port = (uint16_t)atoi(argv[1]);
    char error[REUSEPORTLB_ERROR_MAX];
    reuseportlb_member *m[2];
    for (int i = 0; i < 2; i++) {
        if (reuseportlb_join("127.0.0.1", port, i, 2, REUSEPORTLB_SOURCE_IP, &m[i], error, sizeof error) != 0) {
            fprintf(stderr, "join: %s\n", error);
            return 1;
        }
    }
    reuseportlb_member *extra;
    int rc = reuseportlb_join("127.0.0.1", port, 0, 2, REUSEPORTLB_SOURCE_IP, &extra, error, sizeof error);
    if (rc != -EADDRINUSE || strstr(error, "slot 0") == NULL) { fprintf(stderr, "expected slot-in-use, got %d %s\n", rc, error); return 1; }
    rc = reuseportlb_join("127.0.0.1", port, 0, 0, REUSEPORTLB_SOURCE_IP, &extra, error, sizeof error);
    if (rc != -EINVAL) { fprintf(stderr, "expected -EINVAL for capacity 0, got %d\n", rc); return 1; }
    for (int s = 0; s < 20; s++) {
        int fd = socket(AF_INET, SOCK_DGRAM, 0);
        struct sockaddr_in from = { .sin_family = AF_INET }, to = { .sin_family = AF_INET, .sin_port = htons(port) };
        char address[32];
        snprintf(address, sizeof address, "127.0.5.%d", s + 10);
        inet_pton(AF_INET, address, &from.sin_addr);
        inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
        if (bind(fd, (struct sockaddr *)&from, sizeof from) != 0) { perror("bind"); return 1; }
        for (int k = 0; k < 2; k++) sendto(fd, "hello", 5, 0, (struct sockaddr *)&to, sizeof to);
        close(fd);
    }
    usleep(100000);
    int received = 0, misplaced = 0;
    for (int i = 0; i < 2; i++) {
        char buffer[64];
        struct sockaddr_in from;
        socklen_t length = sizeof from;
        while (recvfrom(reuseportlb_socket(m[i]), buffer, sizeof buffer, MSG_DONTWAIT, (struct sockaddr *)&from, &length) > 0) {
            char address[32];
            int owner = -1;
            inet_ntop(AF_INET, &from.sin_addr, address, sizeof address);
            if (reuseportlb_owner(m[i], address, ntohs(from.sin_port), &owner) != 0 || owner != reuseportlb_slot(m[i])) misplaced++;
            received++;
            length = sizeof from;
        }
    }
    struct reuseportlb_counters counters;
    if (reuseportlb_counters(m[0], &counters) != 0) return 1;
    /* withdraw m[1]: every source now reaches m[0] */
    if (reuseportlb_withdraw(m[1]) != 0) { fprintf(stderr, "withdraw failed\n"); return 1; }
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in to = { .sin_family = AF_INET, .sin_port = htons(port) };
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    for (int k = 0; k < 20; k++) {
        struct sockaddr_in from = { .sin_family = AF_INET };
        char address[32];
        snprintf(address, sizeof address, "127.0.5.%d", k + 10);
        inet_pton(AF_INET, address, &from.sin_addr);
        int s = socket(AF_INET, SOCK_DGRAM, 0);
        bind(s, (struct sockaddr *)&from, sizeof from);
        sendto(s, "again", 5, 0, (struct sockaddr *)&to, sizeof to);
        close(s);
    }
    close(fd);
    usleep(100000);
    int after = 0;
    char buffer[64];
    while (recv(reuseportlb_socket(m[0]), buffer, sizeof buffer, MSG_DONTWAIT) > 0) after++;
    if (after != 20 || reuseportlb_queued_bytes(m[1]) != 0) { fprintf(stderr, "after withdraw: %d at m[0]\n", after); return 1; }
    /* drained: seal m[1] (nothing reaches it as it closes), sealing twice is no error */
    if (reuseportlb_seal(m[1]) != 0 || reuseportlb_seal(m[1]) != 0) { fprintf(stderr, "seal failed\n"); return 1; }
    printf("received=%d misplaced=%d selected=%llu steering=%s\n", received, misplaced,
           (unsigned long long)counters.selected, reuseportlb_steering(m[0]));
    reuseportlb_leave(m[0]);
    reuseportlb_leave(m[1]);
    /* Bad input: -EINVAL with a message, never a crash. */
    rc = reuseportlb_join("127.0.0.1", 0, 0, 2, REUSEPORTLB_SOURCE_IP, &extra, error, sizeof error);
    if (rc != -EINVAL || strstr(error, "port 0") == NULL) { fprintf(stderr, "port 0: %d %s\n", rc, error); return 1; }
    rc = reuseportlb_join("fe80::1%lo", port, 0, 2, REUSEPORTLB_SOURCE_IP, &extra, error, sizeof error);
    if (rc != -EINVAL || strstr(error, "scoped") == NULL) { fprintf(stderr, "scoped: %d %s\n", rc, error); return 1; }
    struct reuseportlb_counters unused;
    int owner = -1;
    if (reuseportlb_socket(NULL) != -EINVAL || reuseportlb_slot(NULL) != -EINVAL || reuseportlb_steering(NULL) != NULL
        || reuseportlb_is_replaced(NULL) != -EINVAL || reuseportlb_queued_bytes(NULL) != -EINVAL
        || reuseportlb_counters(NULL, &unused) != -EINVAL || reuseportlb_owner(NULL, "127.0.0.1", 0, &owner) != -EINVAL
        || reuseportlb_withdraw(NULL) != -EINVAL || reuseportlb_seal(NULL) != -EINVAL) { fprintf(stderr, "a NULL handle was not -EINVAL\n"); return 1; }
    reuseportlb_leave(NULL);
    /* fiveTuple: one address, many ports; the owner with the port names the receiver. */
    reuseportlb_member *f[2];
    for (int i = 0; i < 2; i++) {
        if (reuseportlb_join("127.0.0.1", port, i, 2, REUSEPORTLB_FIVE_TUPLE, &f[i], error, sizeof error) != 0) {
            fprintf(stderr, "join fiveTuple: %s\n", error);
            return 1;
        }
    }
    int fiveReceived = 0, fiveMisplaced = 0, used[2] = {0, 0};
    for (int p = 0; p < 30; p++) {
        int s = socket(AF_INET, SOCK_DGRAM, 0);
        struct sockaddr_in from = { .sin_family = AF_INET, .sin_port = htons(42000 + p) }, to = { .sin_family = AF_INET, .sin_port = htons(port) };
        inet_pton(AF_INET, "127.0.0.9", &from.sin_addr);
        inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
        if (bind(s, (struct sockaddr *)&from, sizeof from) != 0) { perror("bind"); return 1; }
        sendto(s, "five", 4, 0, (struct sockaddr *)&to, sizeof to);
        close(s);
        usleep(2000);
        int expected = -1;
        if (reuseportlb_owner(f[0], "127.0.0.9", 42000 + p, &expected) != 0) return 1;
        char buffer[16];
        for (int i = 0; i < 2; i++) {
            while (recv(reuseportlb_socket(f[i]), buffer, sizeof buffer, MSG_DONTWAIT) > 0) {
                fiveReceived++;
                used[i] = 1;
                if (reuseportlb_slot(f[i]) != expected) fiveMisplaced++;
            }
        }
    }
    reuseportlb_leave(f[0]);
    reuseportlb_leave(f[1]);
    if (fiveReceived != 30 || fiveMisplaced != 0 || !used[0] || !used[1]) {
        fprintf(stderr, "fiveTuple: received %d misplaced %d\n", fiveReceived, fiveMisplaced);
        return 1;
    }
    return received == 40 && misplaced == 0 ? 0 : 1;
}
