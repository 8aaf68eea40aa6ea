#ifndef CLIBXDP_SHIM_H
#define CLIBXDP_SHIM_H
#include <xdp/libxdp.h>
#include <xdp/xsk.h>
#endif
