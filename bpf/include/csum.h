/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * One's-complement checksum helpers (RFC 1071/1624) shared by the BPF programs. Words are
 * taken as they lie in memory on both sides of every update, which the checksum's byte-order
 * independence makes correct.
 */
#ifndef FANOUT_CSUM_H
#define FANOUT_CSUM_H

#include <linux/types.h>
#include <bpf/bpf_helpers.h>

/* Folds a 64-bit sum of 16-bit words into 16 bits, end-around carry included. */
static __always_inline __u16 csum_fold64(__u64 sum)
{
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

/* HC' = ~(~HC + ~m + m') for one 16-bit word m changed to m'. */
static __always_inline __u16 csum_update16(__u16 check, __u16 old, __u16 new)
{
	return ~csum_fold64((__u64)(__u16)~check + (__u16)~old + new);
}

/* The same for a 32-bit field (two words) changed from old to new. */
static __always_inline __u16 csum_update32(__u16 check, __u32 old, __u32 new)
{
	return ~csum_fold64((__u64)(__u16)~check + (~old & 0xffff) + (~old >> 16) + (new & 0xffff) + (new >> 16));
}

#endif /* FANOUT_CSUM_H */
