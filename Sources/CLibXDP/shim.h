// SPDX-License-Identifier: Apache-2.0
#ifndef CLIBXDP_SHIM_H
#define CLIBXDP_SHIM_H
#include <xdp/libxdp.h>
#include <xdp/xsk.h>

#include <errno.h>
#include <string.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <linux/ethtool.h>
#include <linux/sockios.h>

/* ETHTOOL_GCHANNELS through SIOCETHTOOL (what `ethtool -l` asks): struct ifreq keeps the
 * request behind a union member Swift cannot set cleanly. `fd` is any socket in the
 * interface's network namespace. Returns 0 and the current RX-only and combined channel
 * counts, or -1 with errno (EOPNOTSUPP: the driver does not report channels). Header-only:
 * this is a system-library target with no compiled sources. */
static inline int xsk_shim_channels(int fd, const char *interface, uint32_t *rx, uint32_t *combined)
{
	struct ethtool_channels channels;
	struct ifreq request;

	memset(&channels, 0, sizeof(channels));
	memset(&request, 0, sizeof(request));
	channels.cmd = ETHTOOL_GCHANNELS;
	if (strlen(interface) >= sizeof(request.ifr_name)) {
		errno = ENAMETOOLONG;
		return -1;
	}
	strncpy(request.ifr_name, interface, sizeof(request.ifr_name) - 1);
	request.ifr_data = (void *)&channels;
	if (ioctl(fd, SIOCETHTOOL, &request) < 0)
		return -1;
	*rx = channels.rx_count;
	*combined = channels.combined_count;
	return 0;
}

#endif
