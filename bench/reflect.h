// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * What the benchmarks' packet reflectors share (make bench only, never embedded): the swap that
 * turns a received IPv4 UDP datagram into one going back where it came from. Swapping the
 * Ethernet, IP and UDP sources and destinations leaves the IP and UDP checksums valid (sums
 * commute); the TTL, which every router takes one from, is set back to 64 (the IP header
 * checksum updated as in RFC 1624), so a datagram can lap for ever.
 */
#ifndef BENCH_REFLECT_H
#define BENCH_REFLECT_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "csum.h"

/* The UDP checksum's offset, for the checksum helpers (an IPv4 header without options). */
#define REFLECT_UDP_CHECK (sizeof(struct ethhdr) + sizeof(struct iphdr) + __builtin_offsetof(struct udphdr, check))

/* A frame's headers, as reflect_parse found them. */
struct reflect_frame {
	struct ethhdr *eth;
	struct iphdr *ip;
	struct udphdr *udp;
};

/* Fills `frame` and returns 1 if the frame is an IPv4 UDP datagram without options or
 * fragmentation (anything else is the stack's: ARP, ICMP, IPv6), else 0. */
static __always_inline int reflect_parse_data(void *data, void *data_end, struct reflect_frame *frame)
{
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return 0;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->protocol != IPPROTO_UDP || ip->ihl != 5
	    || (ip->frag_off & bpf_htons(0x3fff)))
		return 0;
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > data_end)
		return 0;
	frame->eth = eth;
	frame->ip = ip;
	frame->udp = udp;
	return 1;
}

static __always_inline int reflect_parse(struct __sk_buff *skb, struct reflect_frame *frame)
{
	return reflect_parse_data((void *)(long)skb->data, (void *)(long)skb->data_end, frame);
}

/* Swaps the frame end for end, TTL back to 64. */
static __always_inline void reflect_swap(struct reflect_frame *frame)
{
	struct ethhdr *eth = frame->eth;
	struct iphdr *ip = frame->ip;
	struct udphdr *udp = frame->udp;
	unsigned char mac[ETH_ALEN];
	__builtin_memcpy(mac, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, mac, ETH_ALEN);
	__be32 address = ip->saddr;
	ip->saddr = ip->daddr;
	ip->daddr = address;
	__u16 old = *(__u16 *)&ip->ttl; /* the TTL and protocol word, as it lies */
	ip->ttl = 64;
	ip->check = csum_update16(ip->check, old, *(__u16 *)&ip->ttl);
	__be16 port = udp->source;
	udp->source = udp->dest;
	udp->dest = port;
}

#endif /* BENCH_REFLECT_H */
