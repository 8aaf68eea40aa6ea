// SPDX-License-Identifier: Apache-2.0
#ifndef CYAML_SHIM_H
#define CYAML_SHIM_H
#include <yaml.h>
#endif
