#pragma once
// Moved to torchpar/rpc/rpc_group.h (RPC is a layer of its own); kept so programs that include
// this path still build.
#include "torchpar/rpc/rpc_group.h"
