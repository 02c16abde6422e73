"""torchpar for Python: torchpar's C++ parallel runtime under the APIs Python users know.

    import torch
    import torchpar.multiprocessing as mp   # a drop-in for torch.multiprocessing

The runtime is C++ (torchpar._C, linked against the LibTorch python3-torch runs on); this
package is the thin Python front over it. See docs/python.md.
"""
try:
    import torch  # noqa: F401  (torchpar._C converts torch.Tensor with LibTorch's bindings)
except ImportError as e:  # pragma: no cover - depends on the machine
    raise ImportError(
        f"torchpar needs PyTorch, and `import torch` failed ({e}). Install Debian's "
        "python3-torch (scripts/install-deps.sh) and run /usr/bin/python3.") from e

from torchpar._C import (  # noqa: E402
    ClosedError,
    Error,
    PeerLostError,
    RemoteRaisedError,
    SerializationError,
    TimeoutError,
    WorkerLostError,
    __version__,
)

__all__ = [
    "ClosedError",
    "Error",
    "PeerLostError",
    "RemoteRaisedError",
    "SerializationError",
    "TimeoutError",
    "WorkerLostError",
    "__version__",
]
