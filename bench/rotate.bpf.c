// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * The clients' side of the two-way scale benchmark (make bench only, never embedded): at tc
 * ingress of the clients' veth, it turns each reply into the next request of another client, so
 * that a fixed number of datagrams lapping through the load balancer keep CLIENTS distinct
 * clients (address and port) active, each in turn.
 *
 * Client i is FIRST_ADDRESS + i / PORTS, port FIRST_PORT + i % PORTS. A reply to client i (from
 * the load balancer's address) goes back out as a request from client (i + STRIDE) mod CLIENTS
 * (reflect.h's swap, then the source address and port rewritten with the checksum helpers, which
 * handle an offloaded checksum). With STRIDE datagrams in flight, started at clients 0..STRIDE-1,
 * and CLIENTS a multiple of STRIDE, every client is visited once per CLIENTS round trips.
 *
 * The servers' reflectors (reflect.bpf.c built with -DSTAMP) put the answering server's address
 * in the first 4 payload bytes; per client this program keeps the last one (rotate_server) and
 * counts, per reply, whether the client's server was kept, changed, or seen for the first time
 * (rotate_counts: laps, first, kept, changed): what a client experiences when its association or
 * session was forgotten between its turns.
 *
 * Anything else (ARP, another address, a datagram without a stamp) goes to the stack.
 * Build: clang -target bpf -DCLIENTS=N -DSTRIDE=F (and -I bpf/include for csum.h).
 */
#include <linux/pkt_cls.h>
#include "reflect.h"

#ifndef CLIENTS
#define CLIENTS 1024
#endif
#ifndef STRIDE
#define STRIDE 256
#endif
#define FIRST_ADDRESS 0xc6130000u /* 198.19.0.0 */
#define FIRST_PORT 20000u
#define PORTS 40000u

enum { LAPS, FIRST, KEPT, CHANGED, COUNTS };

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CLIENTS);
	__type(key, __u32);
	__type(value, __u32);
} rotate_server SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, COUNTS);
	__type(key, __u32);
	__type(value, __u64);
} rotate_counts SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *value = bpf_map_lookup_elem(&rotate_counts, &which);
	if (value)
		__sync_fetch_and_add(value, 1);
}

SEC("tc")
int rotate(struct __sk_buff *skb)
{
	struct reflect_frame frame;
	if (!reflect_parse(skb, &frame))
		return TC_ACT_OK;
	struct iphdr *ip = frame.ip;
	struct udphdr *udp = frame.udp;
	__be32 *stamp = (void *)(udp + 1);
	if ((void *)(stamp + 1) > (void *)(long)skb->data_end)
		return TC_ACT_OK;
	__u32 address = bpf_ntohl(ip->daddr), port = bpf_ntohs(udp->dest);
	if (address < FIRST_ADDRESS || port < FIRST_PORT || port >= FIRST_PORT + PORTS)
		return TC_ACT_OK;
	__u64 client = (__u64)(address - FIRST_ADDRESS) * PORTS + (port - FIRST_PORT);
	if (client >= CLIENTS)
		return TC_ACT_OK;
	__u32 key = client;
	__u32 *last = bpf_map_lookup_elem(&rotate_server, &key);
	if (!last)
		return TC_ACT_OK;
	count(LAPS);
	count(*last == 0 ? FIRST : *last == *stamp ? KEPT : CHANGED);
	*last = *stamp;

	__u64 next = client + STRIDE;
	if (next >= CLIENTS)
		next -= CLIENTS;
	__be32 old_address = ip->daddr, new_address = bpf_htonl(FIRST_ADDRESS + (__u32)(next / PORTS));
	__be16 old_port = udp->dest, new_port = bpf_htons(FIRST_PORT + (__u32)(next % PORTS));
	reflect_swap(&frame); /* now from client i to the load balancer */
	ip->saddr = new_address;
	ip->check = csum_update32(ip->check, old_address, new_address);
	udp->source = new_port;
	bpf_l4_csum_replace(skb, REFLECT_UDP_CHECK, old_address, new_address, BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(new_address));
	bpf_l4_csum_replace(skb, REFLECT_UDP_CHECK, old_port, new_port, BPF_F_MARK_MANGLED_0 | sizeof(new_port));
	return bpf_redirect(skb->ifindex, 0);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
