"""Filters for torch warnings users can do nothing about, applied only inside metadist's calls
(process-wide filters would hide them from the user's own code)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["quiet_torch_warnings"]

# Regular expressions matched at the start of warnings torch raises while metadist drives it:
# init_rpc gathers worker infos over its internal Gloo group through a deprecated code path.
_MESSAGES = (r"You are using a Backend .*ProcessGroupGloo.* as a ProcessGroup",)


@contextlib.contextmanager
def quiet_torch_warnings() -> Iterator[None]:
    """Silence torch's known-noise warnings for the duration of the block."""
    with warnings.catch_warnings():
        for message in _MESSAGES:
            warnings.filterwarnings("ignore", message=message)
        yield
