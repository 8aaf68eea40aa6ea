// SPDX-License-Identifier: Apache-2.0
#define _GNU_SOURCE
#include "CSystemShim.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <netinet/udp.h>
#include <stdlib.h>
#include <netinet/in.h>
#include <linux/errqueue.h>
#include <arpa/nameser.h>
#include <resolv.h>
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif

_Static_assert(sizeof(struct shim_mmsghdr) == sizeof(struct mmsghdr), "mmsghdr layout");

int shim_recvmmsg(int fd, struct shim_mmsghdr *vector, unsigned int count, int flags)
{
	return recvmmsg(fd, (struct mmsghdr *)vector, count, flags, NULL);
}

int shim_sendmmsg(int fd, struct shim_mmsghdr *vector, unsigned int count, int flags)
{
	return sendmmsg(fd, (struct mmsghdr *)vector, count, flags);
}

int shim_rxq_ovfl(const struct msghdr *message, uint32_t *drops)
{
	for (struct cmsghdr *c = CMSG_FIRSTHDR((struct msghdr *)message); c != NULL;
	     c = CMSG_NXTHDR((struct msghdr *)message, c)) {
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_RXQ_OVFL) {
			memcpy(drops, CMSG_DATA(c), sizeof(*drops));
			return 1;
		}
	}
	return 0;
}

unsigned int shim_rxq_ovfl_space(void)
{
	return CMSG_SPACE(sizeof(uint32_t));
}

int shim_enable_error_queue(int fd, int family)
{
	int on = 1;
	if (family == AF_INET6)
		return setsockopt(fd, SOL_IPV6, IPV6_RECVERR, &on, sizeof(on)) == 0 ? 0 : -errno;
	return setsockopt(fd, SOL_IP, IP_RECVERR, &on, sizeof(on)) == 0 ? 0 : -errno;
}

int shim_drop_all_input(int fd)
{
	/* One classic BPF instruction, "return 0": every datagram arriving is dropped before the
	 * queue (ICMP errors do not pass the filter: they reach the error queue). */
	struct sock_filter code[] = { BPF_STMT(BPF_RET | BPF_K, 0) };
	struct sock_fprog program = { .len = 1, .filter = code };
	return setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &program, sizeof(program)) == 0 ? 0 : -errno;
}

int shim_read_error_queue(int fd, struct sockaddr_storage *destination, int *error)
{
	char control[512];
	char data[1];
	struct iovec vector = { data, sizeof(data) };
	struct msghdr message;
	memset(&message, 0, sizeof(message));
	memset(destination, 0, sizeof(*destination));
	message.msg_name = destination;
	message.msg_namelen = sizeof(*destination);
	message.msg_iov = &vector;
	message.msg_iovlen = 1;
	message.msg_control = control;
	message.msg_controllen = sizeof(control);
	if (recvmsg(fd, &message, MSG_ERRQUEUE | MSG_DONTWAIT) < 0)
		return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
	*error = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c != NULL; c = CMSG_NXTHDR(&message, c)) {
		if ((c->cmsg_level == SOL_IP && c->cmsg_type == IP_RECVERR) ||
		    (c->cmsg_level == SOL_IPV6 && c->cmsg_type == IPV6_RECVERR)) {
			struct sock_extended_err extended;
			memcpy(&extended, CMSG_DATA(c), sizeof(extended));
			*error = (int)extended.ee_errno;
		}
	}
	return 1;
}

static volatile sig_atomic_t stop_flag;
static volatile sig_atomic_t hangup_flag;

static void on_signal(int signo)
{
	if (signo == SIGHUP)
		hangup_flag = 1;
	else
		stop_flag = 1;
}

void shim_install_signal_flags(void)
{
	struct sigaction action;
	memset(&action, 0, sizeof(action));
	action.sa_handler = on_signal;
	sigemptyset(&action.sa_mask);
	sigaction(SIGINT, &action, NULL);
	sigaction(SIGTERM, &action, NULL);
	sigaction(SIGHUP, &action, NULL);
	/* A parent may have left these blocked (posix_spawn copies the mask): unblock them. */
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGHUP);
	pthread_sigmask(SIG_UNBLOCK, &set, NULL);
}

int shim_stop_requested(void)
{
	return stop_flag != 0;
}

int shim_take_hangup(void)
{
	if (!hangup_flag)
		return 0;
	hangup_flag = 0;
	return 1;
}

int shim_setns(int fd, int nstype)
{
	return setns(fd, nstype);
}

int shim_unshare(int flags)
{
	return unshare(flags);
}

int shim_pin_current_thread(int cpu)
{
	cpu_set_t set;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	int error = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	if (error != 0) {
		errno = error;
		return -1;
	}
	return 0;
}

int shim_allowed_cpus(int *cpus, int max)
{
	cpu_set_t set;
	CPU_ZERO(&set);
	/* getpid(): the main thread's mask, whichever thread asks (a worker may have pinned itself). */
	if (sched_getaffinity(getpid(), sizeof(set), &set) != 0)
		return -1;
	int count = 0;
	for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
		if (!CPU_ISSET(cpu, &set))
			continue;
		if (count < max)
			cpus[count] = cpu;
		count++;
	}
	return count;
}

int shim_attach_reuseport_cbpf(int fd, const struct sock_filter *filter, unsigned short length)
{
	struct sock_fprog program = { .len = length, .filter = (struct sock_filter *)filter };
	return setsockopt(fd, SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, &program, sizeof(program));
}

int shim_is_bpffs(const char *path)
{
	struct statfs info;
	if (statfs(path, &info) != 0)
		return -1;
	return info.f_type == BPF_FS_MAGIC ? 1 : 0;
}

int shim_set_thread_name(unsigned long thread, const char *name)
{
	return pthread_setname_np((pthread_t)thread, name);
}

unsigned int shim_udp_segment_space(void)
{
	return CMSG_SPACE(sizeof(uint16_t));
}

void shim_set_udp_segment(struct msghdr *message, void *control, uint16_t size)
{
	if (size == 0) {
		message->msg_control = NULL;
		message->msg_controllen = 0;
		return;
	}
	memset(control, 0, CMSG_SPACE(sizeof(uint16_t)));
	message->msg_control = control;
	message->msg_controllen = CMSG_SPACE(sizeof(uint16_t));
	struct cmsghdr *c = CMSG_FIRSTHDR(message);
	c->cmsg_level = SOL_UDP;
	c->cmsg_type = UDP_SEGMENT;
	c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
	memcpy(CMSG_DATA(c), &size, sizeof(size));
}

int shim_dns_send(const char *name, int type, const struct sockaddr_storage *servers, int count,
		  int timeout_seconds, int attempts, unsigned char *answer, int answer_length,
		  uint16_t *query_id, int *error)
{
	struct __res_state state;
	memset(&state, 0, sizeof(state));
	if (res_ninit(&state) != 0) {
		*error = errno;
		return -2;
	}
	/* res_ninit left the nameservers of resolv.conf (IPv6 ones malloc'd): replace them. */
	if (count > 0) {
		for (int i = 0; i < MAXNS; i++) {
			free(state._u._ext.nsaddrs[i]);
			state._u._ext.nsaddrs[i] = NULL;
			state._u._ext.nssocks[i] = -1;
		}
		int used = 0;
		for (int i = 0; i < count && used < MAXNS; i++) {
			if (servers[i].ss_family == AF_INET) {
				memcpy(&state.nsaddr_list[used++], &servers[i], sizeof(struct sockaddr_in));
			} else if (servers[i].ss_family == AF_INET6) {
				struct sockaddr_in6 *copy = malloc(sizeof(*copy));
				if (copy == NULL) {
					res_nclose(&state);
					*error = ENOMEM;
					return -2;
				}
				memcpy(copy, &servers[i], sizeof(*copy));
				/* glibc reads a server from nsaddrs[n] when nsaddr_list[n] has family 0. */
				state.nsaddr_list[used].sin_family = 0;
				state._u._ext.nsaddrs[used++] = copy;
			}
		}
		state.nscount = used;
	}
	state.retrans = timeout_seconds;
	state.retry = attempts;
	unsigned char query[512];
	int length = res_nmkquery(&state, QUERY, name, C_IN, type, NULL, 0, NULL, query, sizeof(query));
	if (length < 12) {
		*error = errno;
		res_nclose(&state);
		return -3;
	}
	*query_id = (uint16_t)((query[0] << 8) | query[1]);
	/* A stale buffer must never look like this query's answer. */
	memset(answer, 0, answer_length < 12 ? (size_t)answer_length : 12);
	errno = 0;
	int received = res_nsend(&state, query, length, answer, answer_length);
	*error = errno;
	res_nclose(&state);
	return received;
}

int shim_kernel_grace_period(void)
{
	return (int)syscall(__NR_membarrier, MEMBARRIER_CMD_GLOBAL, 0, 0);
}

int shim_kernel_grace_period_available(void)
{
	long commands = syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
	return commands >= 0 && (commands & MEMBARRIER_CMD_GLOBAL) ? 1 : 0;
}

long shim_send_with_descriptors(int fd, const void *data, size_t length, const struct sockaddr *address,
				socklen_t address_length, const int *descriptors, int count)
{
	if (count < 0 || count > 253)
		return -EINVAL;
	size_t space = CMSG_SPACE(sizeof(int) * (size_t)count);
	char *control = count > 0 ? calloc(1, space) : NULL;
	if (count > 0 && !control)
		return -ENOMEM;
	struct iovec vector = { .iov_base = (void *)data, .iov_len = length };
	struct msghdr message = {
		.msg_name = (void *)address, .msg_namelen = address_length,
		.msg_iov = &vector, .msg_iovlen = 1,
		.msg_control = control, .msg_controllen = count > 0 ? space : 0,
	};
	if (count > 0) {
		struct cmsghdr *header = CMSG_FIRSTHDR(&message);
		header->cmsg_level = SOL_SOCKET;
		header->cmsg_type = SCM_RIGHTS;
		header->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)count);
		memcpy(CMSG_DATA(header), descriptors, sizeof(int) * (size_t)count);
	}
	ssize_t sent = sendmsg(fd, &message, MSG_NOSIGNAL);
	int saved = errno;
	free(control);
	return sent < 0 ? -saved : (long)sent;
}

long shim_receive_with_descriptors(int fd, void *data, size_t length, int *descriptors, int capacity, int *count)
{
	char control[CMSG_SPACE(sizeof(int) * 253)];
	struct iovec vector = { .iov_base = data, .iov_len = length };
	struct msghdr message = { .msg_iov = &vector, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof(control) };
	*count = 0;
	ssize_t received = recvmsg(fd, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	if (received < 0)
		return -errno;
	for (struct cmsghdr *header = CMSG_FIRSTHDR(&message); header; header = CMSG_NXTHDR(&message, header)) {
		if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS)
			continue;
		int n = (int)((header->cmsg_len - CMSG_LEN(0)) / sizeof(int));
		int *received_fds = (int *)CMSG_DATA(header);
		for (int i = 0; i < n; i++) {
			if (*count < capacity)
				descriptors[(*count)++] = received_fds[i];
			else
				close(received_fds[i]);
		}
	}
	return (long)received;
}

int shim_memfd(const char *name)
{
	int fd = memfd_create(name, MFD_CLOEXEC);
	return fd < 0 ? -errno : fd;
}
