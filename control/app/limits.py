"""Per-tenant limits on what a tenant may register, and checks on the submitted folder itself.

Run by ``CatalogueDesk.register_adapter`` around ``control.app.validation`` (which owns the
content checks: allowed file names, no symlinks or subdirectories, safetensors only, shapes,
values):

- ``check_submission`` before anything is copied: the folder is a real directory reached without
  symlinks, no entry escapes it (path traversal, symlinks anywhere), no special files, and no
  file is larger than the tenant's ``max_file_bytes`` (so an oversized upload is refused before a
  byte of it is read);
- ``check_rank_limit`` / ``check_targets`` after validation: the tenant's rank limit and the
  target modules allowed on that base;
- ``check_adapter_count`` before registration: the tenant's maximum number of live adapters.

Failures are ``ValidationFailed`` with check ``limits`` (or ``files`` for the folder's shape)
and a message that names only the tenant's own submission.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from control.domain import TenantPolicy, ValidationFailed

# Absolute ceiling whatever the policy says: an adapter file this large is not a LoRA adapter.
MAX_FILE_BYTES = 4 << 30
DEFAULT_MAX_FILE_BYTES = 1 << 30


def check_submission(src: Path, policy: TenantPolicy) -> None:
    """Refuse a folder with symlinks, entries escaping it, special files or oversized files."""
    if src.is_symlink() or not src.is_dir():
        raise ValidationFailed("files", "the adapter must be a directory (not a symlink)")
    root = os.path.realpath(src)
    limit = min(policy.max_file_bytes or DEFAULT_MAX_FILE_BYTES, MAX_FILE_BYTES)
    # lstat-based walk: nothing is followed, nothing is opened.
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, src)
            shown = _shown(rel)
            if ".." in Path(rel).parts or not os.path.realpath(full).startswith(root + os.sep):
                if os.path.islink(full):
                    raise ValidationFailed("files", f"symlinks are not allowed ({shown})")
                raise ValidationFailed("files", f"{shown} leads outside the adapter folder")
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                raise ValidationFailed("files", f"symlinks are not allowed ({shown})")
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise ValidationFailed("files", f"only regular files are allowed ({shown})")
            if st.st_size > limit:
                raise ValidationFailed(
                    "limits", f"{shown} is {st.st_size} bytes; the limit is {limit} bytes")


def _shown(rel: str) -> str:
    # Only the submission's own relative names, shortened; never an absolute path.
    return rel[:120] if not os.path.isabs(rel) else "an entry"


def rank_limit(policy: TenantPolicy, deployment_max: int) -> int:
    """The effective maximum rank: the tenant's limit within the deployment's."""
    return min(policy.max_rank or deployment_max, deployment_max)


def check_targets(policy: TenantPolicy, base_digest: str, target_modules: list[str]) -> None:
    """The target modules allowed for adapters of this tenant on ``base_digest``."""
    allowed = policy.allowed_target_modules.get(base_digest)
    if allowed is None:
        return
    extra = sorted(set(target_modules) - set(allowed))
    if extra:
        raise ValidationFailed(
            "limits", f"target module {extra[0]!r} is not allowed on this base for your tenant "
                      f"(allowed: {', '.join(sorted(allowed))})")


def check_adapter_count(policy: TenantPolicy, live_adapters: int) -> None:
    """At most ``max_adapters`` adapters that are not revoked or deprecated."""
    if policy.max_adapters is not None and live_adapters >= policy.max_adapters:
        raise ValidationFailed(
            "limits", f"your tenant has {live_adapters} live adapters; the limit is "
                      f"{policy.max_adapters} (revoke or deprecate one first)")
