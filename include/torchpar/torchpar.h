#pragma once
/// The umbrella header of torchpar. It also brings ATen's tensor functions (at::zeros, at::full,
/// ...), as torch's own umbrella does, so a program that includes only this header keeps
/// compiling. The component headers (torchpar/ipc/queue.h, torchpar/shm/share.h, ...) include only
/// at::Tensor's class: a translation unit that includes them alone reads about a fifth of the
/// headers; it includes <ATen/ATen.h> itself for the functions it calls.

#include <ATen/ATen.h>

#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/dist/collective_group.h"
#include "torchpar/dist/elastic_state.h"
#include "torchpar/dist/world.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/ipc/listener.h"
#include "torchpar/ipc/queue.h"
#include "torchpar/ipc/shared_value.h"
#include "torchpar/ipc/synchronize.h"
#include "torchpar/manager/containers.h"
#include "torchpar/manager/manager.h"
#include "torchpar/manager/proxy.h"
#include "torchpar/manager/python.h"
#include "torchpar/parallel/distributed_data_parallel.h"
#include "torchpar/parallel/parallel.h"
#include "torchpar/parallel/state_dict.h"
#include "torchpar/pool/async_result.h"
#include "torchpar/pool/pool.h"
#include "torchpar/pool/thread_pool.h"
#include "torchpar/process/exec.h"
#include "torchpar/process/process.h"
#include "torchpar/process/spawn.h"
#include "torchpar/process/start_method.h"
#include "torchpar/rpc/rpc_group.h"
#include "torchpar/serialize/payload.h"
#include "torchpar/serialize/serialize.h"
#include "torchpar/shm/handle.h"
#include "torchpar/shm/share.h"
#include "torchpar/shm/sharing_strategy.h"
#include "torchpar/version.h"
