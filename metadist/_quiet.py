"""Local filters for torch warnings that users of metadist can do nothing about.

The filters apply only inside metadist's own calls (``with quiet_torch_warnings(): ...``), never to
the user's whole process: a user who calls ``torch.jit.script`` directly still sees torch's notice.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["quiet_torch_warnings"]

# Message prefixes (regular expressions matched at the start of the message) of warnings that fire
# inside torch while metadist drives it on the user's behalf.
_MESSAGES = (
    # init_rpc gathers worker infos over its internal Gloo group through a deprecated code path.
    r"You are using a Backend .*ProcessGroupGloo.* as a ProcessGroup",
    # TorchScript is deprecated; metadist scripts its functional optimizers on purpose.
    r".*TorchScript.*deprecated",
    r"`torch.jit.(script|script_method|trace)` is deprecated",
)


@contextlib.contextmanager
def quiet_torch_warnings() -> Iterator[None]:
    """Silence torch's known-noise warnings for the duration of the block."""
    with warnings.catch_warnings():
        for message in _MESSAGES:
            warnings.filterwarnings("ignore", message=message)
        yield
