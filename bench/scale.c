// SPDX-License-Identifier: Apache-2.0
// The scale benchmark's own programs (scripts/bench_scale.py builds this with the system cc):
//
//   scale sink ADDRESS COUNT [drop]
//       binds COUNT UDP sockets on ADDRESS (ports chosen by the kernel), prints "ports P1,P2,..."
//       and then reads them all (epoll, recvmmsg) until SIGTERM; prints {"received": N}. With
//       "drop", each socket has a filter that drops every datagram before its queue and nothing
//       is read ({"received": 0}): what a sender pays ends at the socket lookup, no wake-up.
//   scale forward ADDRESS PORT BALANCING DESTINATIONS_FILE
//       the peer: a minimal one-way forwarder. Binds ADDRESS:PORT (IPv4), receives batches of 64
//       with recvmmsg and sends each batch with one sendmmsg on one unconnected socket, a
//       destination per message (the "ADDRESS PORT" lines of DESTINATIONS_FILE), chosen round
//       robin or by a hash of the source address (BALANCING: round_robin | source_ip). No health,
//       no counters per destination, no GSO: the least such a forwarder does. Prints
//       {"forwarded": N, "failed": N} at SIGTERM.
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
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/filter.h>
#include <sys/epoll.h>
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

static int forward(const char *bind_address, int port, const char *balancing, const char *destinationsFile) {
	FILE *file = fopen(destinationsFile, "r");
	if (!file) fail("destinations file");
	static struct sockaddr_in destinations[100000];
	int count = 0, value;
	char address[64];
	while (count < 100000 && fscanf(file, "%63s %d", address, &value) == 2) {
		destinations[count] = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons(value)};
		if (inet_pton(AF_INET, address, &destinations[count].sin_addr) != 1) fail("destination address");
		count++;
	}
	fclose(file);
	if (count == 0) fail("no destinations");
	int bySource = strcmp(balancing, "source_ip") == 0;
	int in = udp_socket(bind_address, port, 16 << 20);
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
		int got = recvmmsg(in, in_messages, BATCH, MSG_DONTWAIT, NULL);
		if (got <= 0) {
			epoll_wait(epoll, &event, 1, 100);
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

static double seconds_since(const struct timespec *start) {
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (now.tv_sec - start->tv_sec) + (now.tv_nsec - start->tv_nsec) / 1e9;
}

/// Sums 16-bit words for the one's-complement checksum (RFC 1071), not yet folded.
static uint32_t sum_words(const void *data, int length, uint32_t sum) {
	const uint16_t *words = data;
	for (; length > 1; length -= 2) sum += *words++;
	if (length) sum += *(const uint8_t *)words;
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

int main(int argc, char **argv) {
	struct sigaction action = {.sa_handler = on_signal};
	sigaction(SIGTERM, &action, NULL);
	sigaction(SIGINT, &action, NULL);
	if ((argc == 4 || (argc == 5 && strcmp(argv[4], "drop") == 0)) && strcmp(argv[1], "sink") == 0) return sink(argv[2], atoi(argv[3]), argc == 5);
	if (argc == 6 && strcmp(argv[1], "forward") == 0) return forward(argv[2], atoi(argv[3]), argv[4], argv[5]);
	if (argc == 8 && strcmp(argv[1], "blast") == 0) return blast(argv[2], atoi(argv[3]), atol(argv[4]), atol(argv[5]), argv[6], atof(argv[7]));
	fprintf(stderr, "usage: scale sink ADDRESS COUNT [drop] | forward ADDRESS PORT BALANCING DESTINATIONS_FILE | blast ADDRESS PORT COUNT SOURCES FIRST_SOURCE RATE\n");
	return 2;
}
