"""What the compat modules share: the versions autotp was tested on, the error for a private piece a dependency
moved, and a once-per-process warning for an untested major version.

A dependency upgrade that drops a private piece autotp relies on then fails where autotp first reaches for
it, naming the piece and the installed version, instead of as an AttributeError deep inside a training step.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Any

# package -> (the versions autotp was tested on, the major version those share)
TESTED = {
    "torch": ("2.13", 2),
    "transformers": ("5.19–5.24", 5),
    "peft": ("0.17–0.21", 0),
    "accelerate": ("1.15", 1),
}
_warned: set[str] = set()


def installed(package: str) -> str:
    """The installed version of `package` (its distribution's metadata), or "(not installed)"."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def missing(piece: str) -> RuntimeError:
    """The error for `piece`, a dotted name whose first part is the package, that the installed version lacks."""
    package = piece.split(".")[0]
    return RuntimeError(
        f"autotp needs {piece}, which {package} {installed(package)} does not have; autotp was "
        f"tested on {package} {TESTED[package][0]}"
    )


def require(owner: Any, name: str, piece: str) -> Any:
    """`owner.name`, the private `piece` of a dependency (named as in the compat module's table), or `missing`'s
    error naming it."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise missing(piece) from None


def check_versions() -> None:
    """Warn once per process for each of torch, transformers and PEFT installed at a major version autotp was not
    tested on: its private pieces (see each compat module's table) may have moved."""
    for package in ("torch", "transformers", "peft"):
        version = installed(package)
        tested, major = TESTED[package]
        if package in _warned or not version[:1].isdigit() or int(version.split(".")[0]) == major:
            continue
        _warned.add(package)
        warnings.warn(
            f"autotp was tested on {package} {tested}; {package} {version} is installed, whose internals "
            f"autotp relies on may differ",
            stacklevel=2,
        )
