// SPDX-License-Identifier: Apache-2.0
// The scale benchmark's own programs (scripts/bench_scale.py builds this with the system cc):
//
//   scale sink ADDRESS COUNT [drop]
//       binds COUNT UDP sockets on ADDRESS (ports chosen by the kernel), prints "ports P1,P2,..."
//       and then reads them all (epoll, recvmmsg) until SIGTERM; prints {"received": N}. With
//       "drop", each socket has a filter that drops every datagram before its queue and nothing
//       is read ({"received": 0}): what a sender pays ends at the socket lookup, no wake-up.
//   scale forward ADDRESS PORT BALANCING DESTINATIONS_FILE [WAIT]
//       the peer: a minimal one-way forwarder. Binds ADDRESS:PORT (IPv4), receives batches of 64
//       with recvmmsg and sends each batch with one sendmmsg on one unconnected socket, a
//       destination per message (the "ADDRESS PORT" lines of DESTINATIONS_FILE), chosen round
//       robin or by a hash of the source address (BALANCING: round_robin | source_ip). No health,
//       no counters per destination, no GSO: the least such a forwarder does. WAIT, how it waits
//       for the next batch: epoll (the default: recvmmsg without waiting, then epoll_wait),
//       block (recvmmsg itself waits: one system call per wake-up) or poll (recvmmsg without
//       waiting, sched_yield between empty polls, never sleeping: a CPU always busy, given up to
//       any other runnable thread). Prints {"forwarded": N, "failed": N} at SIGTERM.
//   scale tee ADDRESS PORT DESTINATIONS_FILE [raw|udp]
//       the least a userspace copier that keeps the sender's address does (what udp-fanout's
//       output: preserve_source and nfacctd's tee_transparent do): binds ADDRESS:PORT (IPv4),
//       receives batches of 64 with recvmmsg (waiting in it), and sends every datagram to every
//       destination of DESTINATIONS_FILE. raw (the default): with the sender's address and port
//       through one raw socket (IPPROTO_RAW: the IPv4 and UDP headers ours, the UDP checksum
//       computed, the payload's sum once per datagram), all copies of a batch in one sendmmsg,
//       a header and the payload as two iovecs (no copy of the payload). udp: the way out a raw
//       socket is not: a UDP socket per sender address (IP_TRANSPARENT, bound to the sender's
//       address with a port of the kernel's: the address kept, the port not), one sendmmsg per
//       sender a batch, and a sender's consecutive datagrams of one size to one destination
//       sent as one GSO message (UDP_SEGMENT). Prints {"copies": N, "failed": N} at SIGTERM.
//   scale blast ADDRESS PORT COUNT SOURCES FIRST_SOURCE RATE
//       sends COUNT 64-byte UDP datagrams to ADDRESS:PORT at RATE per second (0: as fast as it
//       can) from SOURCES distinct source addresses counting up from FIRST_SOURCE (IPv4, or IPv6
//       in the last 32 bits), one after the other (a raw socket with the headers ours: one socket
//       whatever the number of sources; IPv6 with its mandatory UDP checksum), source port
//       40000; prints {"sent": N, "seconds": S}.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/ip6.h>
#include <netinet/udp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/filter.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/time.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 64
#define SIZE 2048

static volatile sig_atomic_t stopping;
static void on_signal(int signal) { (void)signal; stopping = 1; }

static void fail(const char *what) {
	perror(what);
	exit(1);
}

static int udp_socket(const char *address, int port, int buffer) {
	int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) fail("socket");
	if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buffer, sizeof buffer) < 0) fail("SO_RCVBUFFORCE");
	struct sockaddr_in local = {.sin_family = AF_INET, .sin_port = htons(port)};
	if (inet_pton(AF_INET, address, &local.sin_addr) != 1) fail("address");
	if (bind(fd, (struct sockaddr *)&local, sizeof local) < 0) fail("bind");
	return fd;
}

/// Room for COUNT sockets: the soft limit of open files raised to the hard one.
static void raise_file_limit(void) {
	struct rlimit limit;
	if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
		limit.rlim_cur = limit.rlim_max;
		setrlimit(RLIMIT_NOFILE, &limit);
	}
}

static int sink(const char *address, int count, int drop) {
	raise_file_limit();
	int epoll = epoll_create1(EPOLL_CLOEXEC);
	printf("ports ");
	for (int index = 0; index < count; index++) {
		int fd = udp_socket(address, 0, 1 << 20);
		struct sockaddr_in local;
		socklen_t length = sizeof local;
		getsockname(fd, (struct sockaddr *)&local, &length);
		printf(index ? ",%d" : "%d", ntohs(local.sin_port));
		if (drop) {
			struct sock_filter code[] = {BPF_STMT(BPF_RET | BPF_K, 0)};
			struct sock_fprog program = {.len = 1, .filter = code};
			if (setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &program, sizeof program) < 0) fail("SO_ATTACH_FILTER");
			continue;
		}
		struct epoll_event event = {.events = EPOLLIN, .data.fd = fd};
		if (epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event) < 0) fail("epoll_ctl");
	}
	printf("\n");
	fflush(stdout);
	static char buffers[BATCH][SIZE];
	struct mmsghdr messages[BATCH];
	struct iovec iovecs[BATCH];
	for (int i = 0; i < BATCH; i++) {
		iovecs[i] = (struct iovec){buffers[i], SIZE};
		messages[i] = (struct mmsghdr){.msg_hdr = {.msg_iov = &iovecs[i], .msg_iovlen = 1}};
	}
	unsigned long long received = 0;
	struct epoll_event events[256];
	while (!stopping) {
		int ready = epoll_wait(epoll, events, 256, 100);
		for (int e = 0; e < ready; e++) {
			int got;
			while ((got = recvmmsg(events[e].data.fd, messages, BATCH, MSG_DONTWAIT, NULL)) > 0) received += got;
		}
	}
	printf("{\"received\": %llu}\n", received);
	return 0;
}

static struct sockaddr_in destinations[100000];

/// Reads DESTINATIONS_FILE's "ADDRESS PORT" lines into `destinations`: how many.
static int read_destinations(const char *destinationsFile) {
	FILE *file = fopen(destinationsFile, "r");
	if (!file) fail("destinations file");
	int count = 0, value;
	char address[64];
	while (count < 100000 && fscanf(file, "%63s %d", address, &value) == 2) {
		destinations[count] = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons(value)};
		if (inet_pton(AF_INET, address, &destinations[count].sin_addr) != 1) fail("destination address");
		count++;
	}
	fclose(file);
	if (count == 0) fail("no destinations");
	return count;
}

/// Makes `fd` blocking, its receive waiting at most 100 ms (so SIGTERM is seen).
static void block_with_timeout(int fd) {
	int off = 0;
	if (ioctl(fd, FIONBIO, &off) < 0) fail("FIONBIO");
	struct timeval timeout = {0, 100000};
	if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout) < 0) fail("SO_RCVTIMEO");
}

enum wait { WAIT_EPOLL, WAIT_BLOCK, WAIT_POLL };

static int forward(const char *bind_address, int port, const char *balancing, const char *destinationsFile, enum wait wait) {
	int count = read_destinations(destinationsFile);
	int bySource = strcmp(balancing, "source_ip") == 0;
	int in = udp_socket(bind_address, port, 16 << 20);
	if (wait == WAIT_BLOCK) block_with_timeout(in);
	int out = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	int buffer = 16 << 20;
	setsockopt(out, SOL_SOCKET, SO_SNDBUFFORCE, &buffer, sizeof buffer);
	static char buffers[BATCH][SIZE];
	struct mmsghdr in_messages[BATCH], out_messages[BATCH];
	struct iovec iovecs[BATCH];
	struct sockaddr_in sources[BATCH];
	for (int i = 0; i < BATCH; i++) {
		iovecs[i] = (struct iovec){buffers[i], SIZE};
		in_messages[i] = (struct mmsghdr){.msg_hdr = {.msg_name = &sources[i], .msg_namelen = sizeof sources[i], .msg_iov = &iovecs[i], .msg_iovlen = 1}};
	}
	printf("ready\n");
	fflush(stdout);
	unsigned long long forwarded = 0, failed = 0;
	unsigned next = 0;
	struct epoll_event event = {.events = EPOLLIN};
	int epoll = epoll_create1(EPOLL_CLOEXEC);
	epoll_ctl(epoll, EPOLL_CTL_ADD, in, &event);
	while (!stopping) {
		int got = recvmmsg(in, in_messages, BATCH, wait == WAIT_BLOCK ? MSG_WAITFORONE : MSG_DONTWAIT, NULL);
		if (got <= 0) {
			if (wait == WAIT_EPOLL) epoll_wait(epoll, &event, 1, 100);
			if (wait == WAIT_POLL) sched_yield();
			continue;
		}
		for (int i = 0; i < got; i++) {
			unsigned target;
			if (bySource) {
				uint32_t hash = sources[i].sin_addr.s_addr * 0x9e3779b1u;
				target = (unsigned)(((uint64_t)(hash ^ (hash >> 16)) * count) >> 32);
			} else {
				target = next;
				next = next + 1 == (unsigned)count ? 0 : next + 1;
			}
			iovecs[i].iov_len = in_messages[i].msg_len;
			out_messages[i] = (struct mmsghdr){.msg_hdr = {.msg_name = &destinations[target], .msg_namelen = sizeof destinations[target],
			                                               .msg_iov = &iovecs[i], .msg_iovlen = 1}};
			in_messages[i].msg_hdr.msg_namelen = sizeof sources[i];
		}
		int done = 0;
		while (done < got) {
			int sent = sendmmsg(out, out_messages + done, got - done, MSG_DONTWAIT);
			if (sent <= 0) {
				failed++;
				done++;
				continue;
			}
			done += sent;
			forwarded += sent;
		}
		for (int i = 0; i < got; i++) iovecs[i].iov_len = SIZE;
	}
	printf("{\"forwarded\": %llu, \"failed\": %llu}\n", forwarded, failed);
	return 0;
}

enum { TEE_DESTINATIONS = 8, HEADERS = sizeof(struct iphdr) + sizeof(struct udphdr) };

static int tee(const char *bind_address, int port, const char *destinationsFile, int udp);

static double seconds_since(const struct timespec *start) {
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (now.tv_sec - start->tv_sec) + (now.tv_nsec - start->tv_nsec) / 1e9;
}

/// Sums 16-bit words for the one's-complement checksum (RFC 1071), not yet folded. Reads through
/// memcpy: the headers summed are written as structs, and reading them as uint16_t directly would
/// break C's aliasing rules (at -O2 the compiler may then sum them before they are written).
static uint32_t sum_words(const void *data, int length, uint32_t sum) {
	const unsigned char *bytes = data;
	uint16_t word;
	for (; length > 1; length -= 2, bytes += 2) {
		memcpy(&word, bytes, 2);
		sum += word;
	}
	if (length) sum += *bytes;
	return sum;
}

static uint16_t fold(uint32_t sum) {
	while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
	return (uint16_t)~sum;
}

/// Paces a sender: returns once the next batch is due at `rate` per second (0: at once).
static void pace(long sent, double rate, const struct timespec *start) {
	if (rate <= 0) return;
	double ahead = sent / rate - seconds_since(start);
	if (ahead > 0) {
		struct timespec pause = {(time_t)ahead, (long)((ahead - (time_t)ahead) * 1e9)};
		nanosleep(&pause, NULL);
	}
}

enum { PAYLOAD = 64, IP4 = sizeof(struct iphdr), IP6 = sizeof(struct ip6_hdr), UDP = sizeof(struct udphdr) };

/// One raw packet sender's state: the batch of packets (IP header, UDP header, 64 bytes) and where
/// each one's source address goes.
struct blaster {
	int fd, family, header;
	unsigned char packets[BATCH][IP6 + UDP + PAYLOAD];
	struct mmsghdr messages[BATCH];
	struct iovec iovecs[BATCH];
	union { struct sockaddr_in v4; struct sockaddr_in6 v6; } destination;
	uint32_t base; /* the first source's address (IPv6: its last 32 bits), host order */
};

/// Writes source number `source` into packet `i` and fixes what covers it (IPv4: the header
/// checksum, the UDP checksum left 0; IPv6: the UDP checksum, which it must carry).
static void set_source(struct blaster *b, int i, uint32_t source) {
	if (b->family == AF_INET) {
		struct iphdr *ip = (struct iphdr *)b->packets[i];
		ip->saddr = htonl(b->base + source);
		ip->check = 0;
		ip->check = fold(sum_words(ip, IP4, 0));
		return;
	}
	struct ip6_hdr *ip = (struct ip6_hdr *)b->packets[i];
	ip->ip6_src.s6_addr32[3] = htonl(b->base + source);
	struct udphdr *udp = (struct udphdr *)(ip + 1);
	udp->check = 0;
	uint32_t sum = sum_words(&ip->ip6_src, 32, 0) + htons(UDP + PAYLOAD) + htons(IPPROTO_UDP);
	udp->check = fold(sum_words(udp, UDP + PAYLOAD, sum));
	if (!udp->check) udp->check = 0xffff;
}

static int blast(const char *address, int port, long count, long sources, const char *first, double rate) {
	static struct blaster b;
	b.family = strchr(address, ':') ? AF_INET6 : AF_INET;
	b.header = b.family == AF_INET ? IP4 : IP6;
	/* IPPROTO_RAW: the IP header is ours (IPv4: IP_HDRINCL; IPv6 likewise), one socket for every source */
	b.fd = socket(b.family, SOCK_RAW | SOCK_CLOEXEC, IPPROTO_RAW);
	if (b.fd < 0) fail("socket(SOCK_RAW)");
	int buffer = 16 << 20;
	setsockopt(b.fd, SOL_SOCKET, SO_SNDBUFFORCE, &buffer, sizeof buffer);
	unsigned char first_address[16], target[16];
	if (inet_pton(b.family, address, target) != 1 || inet_pton(b.family, first, first_address) != 1) fail("address");
	socklen_t length;
	if (b.family == AF_INET) {
		b.destination.v4 = (struct sockaddr_in){.sin_family = AF_INET};
		memcpy(&b.destination.v4.sin_addr, target, 4);
		b.base = ntohl(*(uint32_t *)first_address);
		length = sizeof b.destination.v4;
	} else {
		b.destination.v6 = (struct sockaddr_in6){.sin6_family = AF_INET6};
		memcpy(&b.destination.v6.sin6_addr, target, 16);
		b.base = ntohl(*(uint32_t *)(first_address + 12));
		length = sizeof b.destination.v6;
	}
	for (int i = 0; i < BATCH; i++) {
		b.iovecs[i] = (struct iovec){b.packets[i], b.header + UDP + PAYLOAD};
		b.messages[i] = (struct mmsghdr){.msg_hdr = {.msg_name = &b.destination, .msg_namelen = length, .msg_iov = &b.iovecs[i], .msg_iovlen = 1}};
		if (b.family == AF_INET) {
			*(struct iphdr *)b.packets[i] = (struct iphdr){.version = 4, .ihl = 5, .tot_len = htons(IP4 + UDP + PAYLOAD), .ttl = 64,
			                                               .protocol = IPPROTO_UDP, .daddr = b.destination.v4.sin_addr.s_addr};
		} else {
			struct ip6_hdr *ip = (struct ip6_hdr *)b.packets[i];
			ip->ip6_flow = htonl(6u << 28);
			ip->ip6_plen = htons(UDP + PAYLOAD);
			ip->ip6_nxt = IPPROTO_UDP;
			ip->ip6_hlim = 64;
			memcpy(&ip->ip6_src, first_address, 16);
			ip->ip6_dst = b.destination.v6.sin6_addr;
		}
		struct udphdr *udp = (struct udphdr *)(b.packets[i] + b.header);
		*udp = (struct udphdr){.source = htons(40000), .dest = htons(port), .len = htons(UDP + PAYLOAD)};
		memset(udp + 1, 'x', PAYLOAD);
	}
	struct timespec start;
	clock_gettime(CLOCK_MONOTONIC, &start);
	long sent = 0, source = 0;
	/* Bounded in time too: a send path that keeps refusing (ENOBUFS) ends the run after 600 s. */
	while (sent < count && !stopping && seconds_since(&start) < 600) {
		pace(sent, rate, &start);
		int batch = count - sent < BATCH ? (int)(count - sent) : BATCH;
		for (int i = 0; i < batch; i++) {
			set_source(&b, i, (uint32_t)source);
			source = source + 1 == sources ? 0 : source + 1;
		}
		int done = sendmmsg(b.fd, b.messages, batch, 0);
		if (done < 0) {
			if (errno == ENOBUFS || errno == EAGAIN) continue;
			fail("sendmmsg");
		}
		sent += done;
	}
	printf("{\"sent\": %ld, \"seconds\": %.6f}\n", sent, seconds_since(&start));
	return 0;
}

enum { TEE_SENDERS = 4096 };

/// tee udp's socket for sender address `address` (network order): made on first use.
static int sender_socket(uint32_t address) {
	static struct { uint32_t address; int fd; } senders[TEE_SENDERS];
	for (unsigned i = (address * 0x9e3779b1u) >> 20, n = 0; n < TEE_SENDERS; i = (i + 1) % TEE_SENDERS, n++) {
		if (senders[i].fd && senders[i].address == address) return senders[i].fd;
		if (senders[i].fd) continue;
		int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
		if (fd < 0) fail("socket");
		int on = 1, buffer = 16 << 20;
		if (setsockopt(fd, SOL_IP, IP_TRANSPARENT, &on, sizeof on) < 0) fail("IP_TRANSPARENT");
		setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buffer, sizeof buffer);
		struct sockaddr_in local = {.sin_family = AF_INET, .sin_addr.s_addr = address};
		if (bind(fd, (struct sockaddr *)&local, sizeof local) < 0) fail("bind (the sender's address)");
		senders[i].address = address;
		senders[i].fd = fd;
		return fd;
	}
	fail("tee udp: more than 4096 sender addresses");
	return -1;
}

/// tee udp: sends the batch's datagrams (`lengths`, sources in `sources`) to every destination,
/// one sendmmsg per sender address, a sender's run of one size to one destination as one GSO message.
static void tee_udp(char (*buffers)[SIZE], const int *lengths, const struct sockaddr_in *sources, int got, int count,
                    unsigned long long *copies, unsigned long long *failed) {
	static struct mmsghdr messages[BATCH * TEE_DESTINATIONS];
	static struct iovec iovecs[BATCH * TEE_DESTINATIONS];
	static char controls[BATCH * TEE_DESTINATIONS][CMSG_SPACE(sizeof(uint16_t))];
	static int segments[BATCH * TEE_DESTINATIONS];
	int done[BATCH] = {0};
	for (int first = 0; first < got; first++) {
		if (done[first]) continue;
		uint32_t address = sources[first].sin_addr.s_addr;
		int used = 0, iovs = 0;
		for (int d = 0; d < count; d++) {
			int open = -1;
			for (int i = first; i < got; i++) {
				if (sources[i].sin_addr.s_addr != address || lengths[i] < 0) continue;
				/* a GSO message's segments are of one size (the last may be shorter: not used here) */
				if (open >= 0 && lengths[i] == (int)iovecs[iovs - 1].iov_len && segments[open] < 64
				    && (segments[open] + 1) * lengths[i] <= 65000) {
					iovecs[iovs++] = (struct iovec){buffers[i], (size_t)lengths[i]};
					messages[open].msg_hdr.msg_iovlen++;
					segments[open]++;
					continue;
				}
				open = used++;
				segments[open] = 1;
				iovecs[iovs] = (struct iovec){buffers[i], (size_t)lengths[i]};
				messages[open] = (struct mmsghdr){.msg_hdr = {.msg_name = &destinations[d], .msg_namelen = sizeof destinations[d],
				                                              .msg_iov = &iovecs[iovs], .msg_iovlen = 1}};
				iovs++;
			}
		}
		for (int i = first; i < got; i++)
			if (sources[i].sin_addr.s_addr == address) done[i] = 1;
		for (int m = 0; m < used; m++) {
			if (segments[m] < 2) continue;
			messages[m].msg_hdr.msg_control = controls[m];
			messages[m].msg_hdr.msg_controllen = sizeof controls[m];
			struct cmsghdr *header = CMSG_FIRSTHDR(&messages[m].msg_hdr);
			header->cmsg_level = SOL_UDP;
			header->cmsg_type = UDP_SEGMENT;
			header->cmsg_len = CMSG_LEN(sizeof(uint16_t));
			uint16_t size = (uint16_t)messages[m].msg_hdr.msg_iov[0].iov_len;
			memcpy(CMSG_DATA(header), &size, sizeof size);
		}
		int fd = sender_socket(address), sent = 0;
		while (sent < used) {
			int n = sendmmsg(fd, messages + sent, used - sent, MSG_DONTWAIT);
			if (n <= 0) {
				*failed += segments[sent];
				sent++;
				continue;
			}
			for (int m = sent; m < sent + n; m++) *copies += segments[m];
			sent += n;
		}
	}
}

/// The tee mode (see the top of this file).
static int tee(const char *bind_address, int port, const char *destinationsFile, int udp) {
	int count = read_destinations(destinationsFile);
	if (count > TEE_DESTINATIONS) fail("tee: at most 8 destinations");
	int in = udp_socket(bind_address, port, 16 << 20);
	block_with_timeout(in);
	int out = udp ? -1 : socket(AF_INET, SOCK_RAW | SOCK_CLOEXEC, IPPROTO_RAW);
	if (!udp && out < 0) fail("socket(SOCK_RAW)");
	int buffer = 16 << 20;
	if (!udp) setsockopt(out, SOL_SOCKET, SO_SNDBUFFORCE, &buffer, sizeof buffer);
	static int lengths[BATCH];
	static char buffers[BATCH][SIZE];
	static unsigned char headers[BATCH * TEE_DESTINATIONS][HEADERS];
	static struct mmsghdr in_messages[BATCH], out_messages[BATCH * TEE_DESTINATIONS];
	static struct iovec in_iovecs[BATCH], out_iovecs[BATCH * TEE_DESTINATIONS][2];
	static struct sockaddr_in sources[BATCH];
	for (int i = 0; i < BATCH; i++) {
		in_iovecs[i] = (struct iovec){buffers[i], SIZE};
		in_messages[i] = (struct mmsghdr){.msg_hdr = {.msg_name = &sources[i], .msg_namelen = sizeof sources[i], .msg_iov = &in_iovecs[i], .msg_iovlen = 1}};
	}
	printf("ready\n");
	fflush(stdout);
	unsigned long long copies = 0, failed = 0;
	while (!stopping) {
		int got = recvmmsg(in, in_messages, BATCH, MSG_WAITFORONE, NULL);
		if (got <= 0) continue;
		if (udp) {
			for (int i = 0; i < got; i++) {
				lengths[i] = (int)in_messages[i].msg_len;
				in_messages[i].msg_hdr.msg_namelen = sizeof sources[i];
			}
			tee_udp(buffers, lengths, sources, got, count, &copies, &failed);
			continue;
		}
		int messages = 0;
		for (int i = 0; i < got; i++) {
			int length = (int)in_messages[i].msg_len;
			in_messages[i].msg_hdr.msg_namelen = sizeof sources[i];
			if (length > SIZE - (int)HEADERS) continue;
			uint32_t payload = sum_words(buffers[i], length, 0);
			for (int d = 0; d < count; d++, messages++) {
				struct iphdr *ip = (struct iphdr *)headers[messages];
				struct udphdr *udp = (struct udphdr *)(ip + 1);
				*ip = (struct iphdr){.version = 4, .ihl = 5, .tot_len = htons(HEADERS + length), .ttl = 64, .protocol = IPPROTO_UDP,
				                     .saddr = sources[i].sin_addr.s_addr, .daddr = destinations[d].sin_addr.s_addr};
				*udp = (struct udphdr){.source = sources[i].sin_port, .dest = destinations[d].sin_port, .len = htons(sizeof *udp + length)};
				/* the kernel fills in the IPv4 header's checksum (and id) of an IPPROTO_RAW datagram */
				uint32_t sum = payload + sum_words(&ip->saddr, 8, 0) + htons(IPPROTO_UDP) + udp->len;
				udp->check = fold(sum_words(udp, sizeof *udp, sum));
				if (!udp->check) udp->check = 0xffff;
				out_iovecs[messages][0] = (struct iovec){headers[messages], HEADERS};
				out_iovecs[messages][1] = (struct iovec){buffers[i], (size_t)length};
				out_messages[messages] = (struct mmsghdr){.msg_hdr = {.msg_name = &destinations[d], .msg_namelen = sizeof destinations[d],
				                                                       .msg_iov = out_iovecs[messages], .msg_iovlen = 2}};
			}
		}
		int done = 0;
		while (done < messages) {
			int sent = sendmmsg(out, out_messages + done, messages - done, MSG_DONTWAIT);
			if (sent <= 0) {
				failed++;
				done++;
				continue;
			}
			done += sent;
			copies += sent;
		}
	}
	printf("{\"copies\": %llu, \"failed\": %llu}\n", copies, failed);
	return 0;
}

int main(int argc, char **argv) {
	struct sigaction action = {.sa_handler = on_signal};
	sigaction(SIGTERM, &action, NULL);
	sigaction(SIGINT, &action, NULL);
	if ((argc == 4 || (argc == 5 && strcmp(argv[4], "drop") == 0)) && strcmp(argv[1], "sink") == 0) return sink(argv[2], atoi(argv[3]), argc == 5);
	if ((argc == 6 || argc == 7) && strcmp(argv[1], "forward") == 0) {
		const char *wait = argc == 7 ? argv[6] : "epoll";
		if (strcmp(wait, "epoll") && strcmp(wait, "block") && strcmp(wait, "poll")) {
			fprintf(stderr, "scale forward: WAIT is epoll, block or poll, not %s\n", wait);
			return 2;
		}
		return forward(argv[2], atoi(argv[3]), argv[4], argv[5], !strcmp(wait, "block") ? WAIT_BLOCK : !strcmp(wait, "poll") ? WAIT_POLL : WAIT_EPOLL);
	}
	if ((argc == 5 || (argc == 6 && (!strcmp(argv[5], "raw") || !strcmp(argv[5], "udp")))) && strcmp(argv[1], "tee") == 0)
		return tee(argv[2], atoi(argv[3]), argv[4], argc == 6 && !strcmp(argv[5], "udp"));
	if (argc == 8 && strcmp(argv[1], "blast") == 0) return blast(argv[2], atoi(argv[3]), atol(argv[4]), atol(argv[5]), argv[6], atof(argv[7]));
	fprintf(stderr, "usage: scale sink ADDRESS COUNT [drop] | forward ADDRESS PORT BALANCING DESTINATIONS_FILE [epoll|block|poll] | tee ADDRESS PORT DESTINATIONS_FILE [raw|udp] | blast ADDRESS PORT COUNT SOURCES FIRST_SOURCE RATE\n");
	return 2;
}
