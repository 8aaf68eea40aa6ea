// SPDX-License-Identifier: Apache-2.0
/*
 * What Swift cannot reach through Glibc on Linux, kept small; each function says why it is here.
 */
#ifndef CSYSTEMSHIM_H
#define CSYSTEMSHIM_H

#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <linux/filter.h>
#include <linux/sock_diag.h>
/* epoll: Glibc's module map leaves sys/epoll.h out; replies relay waits on a listener socket and
 * its session sockets together. */
#include <sys/epoll.h>

/* struct mmsghdr is hidden by Glibc unless _GNU_SOURCE, and defining that for Swift breaks
 * ordinary socket calls: this is the same layout under our own name. */
struct shim_mmsghdr {
	struct msghdr msg_hdr;
	unsigned int msg_len;
};

/* recvmmsg(2); Glibc hides the declaration. Returns the count or -1 with errno. */
int shim_recvmmsg(int fd, struct shim_mmsghdr *vector, unsigned int count, int flags);

/* sendmmsg(2); Glibc hides the declaration. Returns the count or -1 with errno. */
int shim_sendmmsg(int fd, struct shim_mmsghdr *vector, unsigned int count, int flags);

/* The SO_RXQ_OVFL control message of a received datagram (the socket's drop count so far):
 * CMSG_FIRSTHDR/CMSG_NXTHDR are macros. Returns 1 and stores it, or 0 if absent. */
int shim_rxq_ovfl(const struct msghdr *message, uint32_t *drops);

/* Size of a control buffer holding one UDP_SEGMENT message (CMSG_SPACE is a macro). */
unsigned int shim_udp_segment_space(void);

/* Writes a UDP_SEGMENT control message (UDP GSO: the kernel cuts the message's payload into
 * datagrams of `size` bytes) into `control` and points the message at it; size 0 removes it. */
void shim_set_udp_segment(struct msghdr *message, void *control, uint16_t size);

/* Size of the control buffer that holds the SO_RXQ_OVFL message (CMSG_SPACE is a macro). */
unsigned int shim_rxq_ovfl_space(void);

/* IP_RECVERR (IPV6_RECVERR for AF_INET6) on: ICMP errors about what the socket sent are queued
 * with the destination they were about. 0 or -errno. */
int shim_enable_error_queue(int fd, int family);

/* Attaches a classic BPF filter that drops every datagram arriving at the socket (a send-only
 * socket: nothing piles up in its receive buffer, which its error queue shares). 0 or -errno. */
int shim_drop_all_input(int fd);

/* Waits for an RCU grace period of the kernel (membarrier(2) MEMBARRIER_CMD_GLOBAL, which is
 * synchronize_rcu()): every softirq that started receiving a packet before the call has
 * finished with it, e.g. queued it on the socket a replaced sk_reuseport program selected.
 * 0, or -1 with errno (EINVAL on nohz_full kernels, ENOSYS, EPERM under a seccomp filter). */
int shim_kernel_grace_period(void);

/* Whether shim_kernel_grace_period() can work here: MEMBARRIER_CMD_QUERY lists
 * MEMBARRIER_CMD_GLOBAL (not on nohz_full kernels; a seccomp filter may refuse the query too). */
int shim_kernel_grace_period_available(void);

/* Reads one entry of the socket's error queue: the destination of the datagram it is about into
 * `destination` (address and port) and its errno (ECONNREFUSED: ICMP port unreachable) into
 * `error`. 1 when one was read, 0 when the queue is empty, -errno on failure. */
int shim_read_error_queue(int fd, struct sockaddr_storage *destination, int *error);

/* Installs async-signal-safe handlers that only set a flag for SIGINT, SIGTERM (and SIGHUP,
 * reported separately): a Swift closure cannot be a signal handler under strict concurrency. */
void shim_install_signal_flags(void);
/* 1 once SIGINT or SIGTERM arrived. */
int shim_stop_requested(void);
/* Returns 1 and clears the flag if SIGHUP arrived since the last call. */
int shim_take_hangup(void);

/* setns(2) and unshare(2): Glibc hides both without _GNU_SOURCE. */
int shim_setns(int fd, int nstype);
int shim_unshare(int flags);

/* sched_setaffinity(2) for the calling thread with one CPU (cpu_set_t macros are not imported). */
int shim_pin_current_thread(int cpu);

/* The CPUs the process (its main thread) may run on (sched_getaffinity(2): taskset, systemd CPUAffinity=,
 * a container's cpuset), lowest first: writes at most `max` into `cpus`, returns how many the
 * mask holds, or -1 with errno. */
int shim_allowed_cpus(int *cpus, int max);

/* pthread_setname_np(3): a GNU extension Glibc hides. Names show in top -H and /proc. */
int shim_set_thread_name(unsigned long thread, const char *name);

/* Classic BPF filter for SO_ATTACH_REUSEPORT_CBPF: struct sock_fprog holds a pointer, so the
 * call is kept in C where the array's lifetime is plain. */
int shim_attach_reuseport_cbpf(int fd, const struct sock_filter *filter, unsigned short length);

/* 1 if `path` is a mounted bpffs (statfs magic BPF_FS_MAGIC), 0 if not, -1 with errno:
 * struct statfs is not visible through Glibc's module. */
int shim_is_bpffs(const char *path);

/* sendmsg(2) of `length` bytes to the AF_UNIX datagram socket at `address`, with `count`
 * descriptors (at most 253) in one SCM_RIGHTS message: sd_pid_notify_with_fds(3)'s FDSTORE=1
 * (CMSG_* are macros). The bytes sent, or -errno. */
long shim_send_with_descriptors(int fd, const void *data, size_t length, const struct sockaddr *address,
				socklen_t address_length, const int *descriptors, int count);

/* recvmsg(2) of one datagram and the descriptors of its SCM_RIGHTS messages (close-on-exec), at
 * most `capacity` (more are closed): the bytes received, or -errno; `*count` descriptors stored. */
long shim_receive_with_descriptors(int fd, void *data, size_t length, int *descriptors, int capacity, int *count);

/* memfd_create(2) with MFD_CLOEXEC: Glibc hides it without _GNU_SOURCE. The descriptor, or -errno. */
int shim_memfd(const char *name);

/* A 64-bit store and load another process may read after this one died (crash ledger, a memfd
 * mapped shared): atomic, so no store is torn, split or elided; relaxed, nothing is ordered. */
static inline void shim_store_shared_u64(uint64_t *address, uint64_t value) { __atomic_store_n(address, value, __ATOMIC_RELAXED); }
static inline uint64_t shim_load_shared_u64(const uint64_t *address) { return __atomic_load_n(address, __ATOMIC_RELAXED); }

/* SKF_NET_OFF is defined as an expression Swift does not import. */
static inline int32_t shim_skf_net_off(void) { return SKF_NET_OFF; }
static inline int32_t shim_skf_ad_random(void) { return SKF_AD_OFF + SKF_AD_RANDOM; }

/* One DNS question (class IN, `type`) through glibc's resolver, res_nmkquery(3) + res_nsend(3), on
 * a private resolver state: getaddrinfo(3) gives no TTL, and struct __res_state keeps IPv6
 * nameservers behind a union and malloc'd pointers that Swift cannot set safely. `servers`
 * (`count` AF_INET/AF_INET6 addresses with their ports) replace resolv.conf's nameservers;
 * count 0 keeps /etc/resolv.conf's. Each server gets `attempts` tries of `timeout_seconds`.
 * Returns the answer's length (any rcode but SERVFAIL/REFUSED/NOTIMP, which res_nsend treats as
 * "try the next server"); -1 with *error = errno when no usable answer came (the answer buffer
 * then holds the last server's refusal if its ID equals *query_id); -2 when res_ninit failed,
 * -3 when the name cannot be put in a query (res_nmkquery). Blocking. */
int shim_dns_send(const char *name, int type, const struct sockaddr_storage *servers, int count,
		  int timeout_seconds, int attempts, unsigned char *answer, int answer_length,
		  uint16_t *query_id, int *error);

/* pidfd_open(2) and pidfd_send_signal(2), for `udp-fanout drain`: a signal to the very process
 * whose start time was checked, not to a pid reused meanwhile. syscall(2) is variadic. */
#include <sys/syscall.h>
#include <unistd.h>
static inline int shim_pidfd_open(int pid) { return (int)syscall(SYS_pidfd_open, pid, 0); }
static inline int shim_pidfd_send_signal(int pidfd, int signal) { return (int)syscall(SYS_pidfd_send_signal, pidfd, signal, (void *)0, 0); }

/* io_uring(7), kept to what the relay needs: Glibc wraps none of its system calls (and syscall(2)
 * is variadic), and the rings are shared memory read and written with acquire/release ordering.
 * The relay queues a non-blocking send or receive per datagram (each on its own session socket)
 * and submits them in one io_uring_enter(2) instead of one system call each. Every operation is
 * queued with MSG_DONTWAIT, so the kernel completes it during the submit (-EAGAIN instead of
 * waiting): nothing is left in flight that could touch a buffer after shim_uring_submit returns. */
struct shim_uring;

/* A ring of at least `entries` submissions (rounded up to a power of two; at most 4096), made
 * for the calling thread. NULL with *error = errno when the kernel refuses (ENOSYS: no io_uring;
 * EPERM: kernel.io_uring_disabled, or a seccomp profile such as a container runtime's default;
 * EOPNOTSUPP: a kernel before 5.6, without the send and receive operations; ENOMEM: before
 * 5.12 the rings count against RLIMIT_MEMLOCK). */
struct shim_uring *shim_uring_create(unsigned entries, int *error);
void shim_uring_destroy(struct shim_uring *ring);

/* Queues a send(2) of `length` bytes at `buffer` on `fd` (a connected socket), or a recv(2) into
 * it, with `flags` (MSG_DONTWAIT is added); `data` comes back with its result. Returns 0, or -1
 * when the ring already holds as many operations as it has entries (submit first). */
int shim_uring_queue_send(struct shim_uring *ring, int fd, const void *buffer, unsigned length, int flags, uint64_t data);
int shim_uring_queue_recv(struct shim_uring *ring, int fd, void *buffer, unsigned length, int flags, uint64_t data);

/* Submits what is queued and waits until every operation submitted has its result in the
 * completion ring. Returns how many were submitted, or -errno (the ring is then unusable: the
 * operations still queued are dropped, and the caller should count them and stop using it). */
int shim_uring_submit(struct shim_uring *ring);

/* Tests: makes the next shim_uring_submit fail with `error` as if io_uring_enter had. */
void shim_uring_fail_next_submit(struct shim_uring *ring, int error);

/* Takes the oldest result: 1 with its data and result (bytes, or -errno), 0 when none is left. */
int shim_uring_next(struct shim_uring *ring, uint64_t *data, int32_t *result);

#endif
