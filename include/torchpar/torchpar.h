#pragma once
/// The umbrella header of torchpar.

#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/ipc/queue.h"
#include "torchpar/ipc/shared_value.h"
#include "torchpar/ipc/synchronize.h"
#include "torchpar/process/process.h"
#include "torchpar/process/spawn.h"
#include "torchpar/process/start_method.h"
#include "torchpar/serialize/payload.h"
#include "torchpar/serialize/serialize.h"
#include "torchpar/shm/handle.h"
#include "torchpar/shm/share.h"
#include "torchpar/shm/sharing_strategy.h"
#include "torchpar/version.h"
