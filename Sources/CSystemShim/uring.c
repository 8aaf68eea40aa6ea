// SPDX-License-Identifier: Apache-2.0
/* A minimal io_uring(7) submission/completion pair for the relay (see CSystemShim.h). */
#include "CSystemShim.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <linux/io_uring.h>

#ifndef IORING_SETUP_SUBMIT_ALL
#define IORING_SETUP_SUBMIT_ALL (1U << 7)
#endif

struct shim_uring {
	int fd;
	unsigned entries;
	/* Submission ring: the kernel reads head, we write tail. */
	unsigned *sq_head, *sq_tail, *sq_mask;
	struct io_uring_sqe *sqes;
	unsigned sq_local_tail; /* queued, not yet published */
	/* Completion ring: we read tail and write head. */
	unsigned *cq_head, *cq_tail, *cq_mask;
	struct io_uring_cqe *cqes;
	/* Submitted whose results have not been taken. */
	unsigned in_flight;
	/* Tests: the next submit fails with this errno (0: none). */
	int fail_next;
	void *sq_map, *cq_map;
	size_t sq_map_size, cq_map_size, sqes_size;
};

static int uring_setup(unsigned entries, struct io_uring_params *params)
{
	return (int)syscall(__NR_io_uring_setup, entries, params);
}

static int uring_enter(int fd, unsigned submit, unsigned complete, unsigned flags)
{
	return (int)syscall(__NR_io_uring_enter, fd, submit, complete, flags, NULL, 0);
}

/* 1 if the kernel has the send and receive operations (5.6 and later; io_uring itself is 5.1):
 * a ring on an older kernel would fail every operation with EINVAL. */
static int has_send_and_receive(int fd)
{
	size_t size = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
	struct io_uring_probe *probe = calloc(1, size);
	if (probe == NULL)
		return 0;
	int ok = syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, probe, 256) == 0
		&& probe->last_op >= IORING_OP_RECV
		&& (probe->ops[IORING_OP_SEND].flags & IO_URING_OP_SUPPORTED)
		&& (probe->ops[IORING_OP_RECV].flags & IO_URING_OP_SUPPORTED);
	free(probe);
	return ok;
}

struct shim_uring *shim_uring_create(unsigned entries, int *error)
{
	if (entries == 0 || entries > 4096) {
		*error = EINVAL;
		return NULL;
	}
	struct io_uring_params params;
	memset(&params, 0, sizeof(params));
	/* A failed operation must not stop the ones queued after it. */
	params.flags = IORING_SETUP_SUBMIT_ALL;
	int fd = uring_setup(entries, &params);
	if (fd < 0 && errno == EINVAL) {
		/* Kernels before 5.18 do not know SUBMIT_ALL: without it, a failing submission ends the
		 * batch early and shim_uring_submit submits the rest. */
		memset(&params, 0, sizeof(params));
		fd = uring_setup(entries, &params);
	}
	if (fd < 0) {
		*error = errno;
		return NULL;
	}
	if (!has_send_and_receive(fd)) {
		close(fd);
		*error = EOPNOTSUPP;
		return NULL;
	}
	struct shim_uring *ring = calloc(1, sizeof(*ring));
	if (ring == NULL) {
		*error = ENOMEM;
		close(fd);
		return NULL;
	}
	ring->fd = fd;
	ring->entries = params.sq_entries;
	ring->sq_map_size = params.sq_off.array + params.sq_entries * sizeof(unsigned);
	ring->cq_map_size = params.cq_off.cqes + params.cq_entries * sizeof(struct io_uring_cqe);
	int single = (params.features & IORING_FEAT_SINGLE_MMAP) != 0;
	if (single && ring->cq_map_size > ring->sq_map_size)
		ring->sq_map_size = ring->cq_map_size;
	ring->sq_map = mmap(NULL, ring->sq_map_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
	if (ring->sq_map == MAP_FAILED)
		goto failed;
	if (single) {
		ring->cq_map = ring->sq_map;
	} else {
		ring->cq_map = mmap(NULL, ring->cq_map_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
		if (ring->cq_map == MAP_FAILED) {
			ring->cq_map = NULL;
			goto failed;
		}
	}
	ring->sqes_size = params.sq_entries * sizeof(struct io_uring_sqe);
	ring->sqes = mmap(NULL, ring->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
	if (ring->sqes == MAP_FAILED) {
		ring->sqes = NULL;
		goto failed;
	}
	char *sq = ring->sq_map, *cq = ring->cq_map;
	ring->sq_head = (unsigned *)(sq + params.sq_off.head);
	ring->sq_tail = (unsigned *)(sq + params.sq_off.tail);
	ring->sq_mask = (unsigned *)(sq + params.sq_off.ring_mask);
	ring->cq_head = (unsigned *)(cq + params.cq_off.head);
	ring->cq_tail = (unsigned *)(cq + params.cq_off.tail);
	ring->cq_mask = (unsigned *)(cq + params.cq_off.ring_mask);
	ring->cqes = (struct io_uring_cqe *)(cq + params.cq_off.cqes);
	/* Submission i always uses sqes[i & mask]: the index array is the identity, once. */
	unsigned *array = (unsigned *)(sq + params.sq_off.array);
	for (unsigned i = 0; i < params.sq_entries; i++)
		array[i] = i;
	ring->sq_local_tail = *ring->sq_tail;
	return ring;
failed:
	*error = errno;
	shim_uring_destroy(ring);
	return NULL;
}

void shim_uring_destroy(struct shim_uring *ring)
{
	if (ring == NULL)
		return;
	if (ring->sqes != NULL)
		munmap(ring->sqes, ring->sqes_size);
	if (ring->cq_map != NULL && ring->cq_map != ring->sq_map)
		munmap(ring->cq_map, ring->cq_map_size);
	if (ring->sq_map != NULL && ring->sq_map != MAP_FAILED)
		munmap(ring->sq_map, ring->sq_map_size);
	close(ring->fd);
	free(ring);
}

static struct io_uring_sqe *next_sqe(struct shim_uring *ring)
{
	/* Queued plus in flight stay within the submission ring's entries, so the completion ring
	 * (twice as large) can never overflow. */
	unsigned head = __atomic_load_n(ring->sq_head, __ATOMIC_ACQUIRE);
	if (ring->sq_local_tail - head + ring->in_flight >= ring->entries)
		return NULL;
	struct io_uring_sqe *sqe = &ring->sqes[ring->sq_local_tail & *ring->sq_mask];
	memset(sqe, 0, sizeof(*sqe));
	ring->sq_local_tail++;
	return sqe;
}

static int queue(struct shim_uring *ring, int opcode, int fd, const void *buffer, unsigned length, int flags, uint64_t data)
{
	struct io_uring_sqe *sqe = next_sqe(ring);
	if (sqe == NULL)
		return -1;
	sqe->opcode = (uint8_t)opcode;
	sqe->fd = fd;
	sqe->addr = (uint64_t)(uintptr_t)buffer;
	sqe->len = length;
	/* MSG_DONTWAIT: -EAGAIN at once rather than parked until the socket is ready. */
	sqe->msg_flags = (uint32_t)(flags | MSG_DONTWAIT);
	sqe->user_data = data;
	return 0;
}

int shim_uring_queue_send(struct shim_uring *ring, int fd, const void *buffer, unsigned length, int flags, uint64_t data)
{
	return queue(ring, IORING_OP_SEND, fd, buffer, length, flags | MSG_NOSIGNAL, data);
}

int shim_uring_queue_recv(struct shim_uring *ring, int fd, void *buffer, unsigned length, int flags, uint64_t data)
{
	return queue(ring, IORING_OP_RECV, fd, buffer, length, flags, data);
}

static unsigned queued_count(const struct shim_uring *ring)
{
	return ring->sq_local_tail - __atomic_load_n(ring->sq_head, __ATOMIC_ACQUIRE);
}

static unsigned completions_ready(const struct shim_uring *ring)
{
	return __atomic_load_n(ring->cq_tail, __ATOMIC_ACQUIRE) - *ring->cq_head;
}

int shim_uring_submit(struct shim_uring *ring)
{
	__atomic_store_n(ring->sq_tail, ring->sq_local_tail, __ATOMIC_RELEASE);
	int submitted = 0;
	for (;;) {
		unsigned queued = queued_count(ring);
		/* The kernel waits until the completion ring holds `min_complete` results not taken:
		 * every operation submitted before and now. */
		unsigned expected = ring->in_flight + queued;
		if (queued == 0 && completions_ready(ring) >= expected)
			return submitted;
		int result = ring->fail_next != 0 ? (errno = ring->fail_next, -1) : uring_enter(ring->fd, queued, expected, IORING_ENTER_GETEVENTS);
		ring->fail_next = 0;
		if (result < 0) {
			if (errno == EINTR)
				continue;
			int failure = errno;
			/* Take back what the kernel did not consume. */
			ring->sq_local_tail = __atomic_load_n(ring->sq_head, __ATOMIC_ACQUIRE);
			__atomic_store_n(ring->sq_tail, ring->sq_local_tail, __ATOMIC_RELEASE);
			return -failure;
		}
		ring->in_flight += (unsigned)result;
		submitted += result;
	}
}

void shim_uring_fail_next_submit(struct shim_uring *ring, int error)
{
	ring->fail_next = error;
}

int shim_uring_next(struct shim_uring *ring, uint64_t *data, int32_t *result)
{
	unsigned head = *ring->cq_head;
	if (__atomic_load_n(ring->cq_tail, __ATOMIC_ACQUIRE) == head)
		return 0;
	struct io_uring_cqe *cqe = &ring->cqes[head & *ring->cq_mask];
	*data = cqe->user_data;
	*result = cqe->res;
	__atomic_store_n(ring->cq_head, head + 1, __ATOMIC_RELEASE);
	if (ring->in_flight > 0)
		ring->in_flight--;
	return 1;
}
