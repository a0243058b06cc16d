"""The disk tier: KV blocks as files under `kv_cache_dir`, a size-bounded LRU that survives a restart.

An entry is one full block of the prefix cache, named by its chained hash (which already carries
the weight version and cache salt) inside a *namespace* directory: xxh3 of what every entry's
bytes depend on beyond its tokens — the checkpoint's content fingerprint (or, after
`update_weights`, a tag drawn for those weights, so nothing computed by them is ever reused by
another process), the dtype and the block geometry. A file is

    header: magic "CUTTLEKV", format, namespace, key, token count, payload bytes, xxh3-64 checksum
    tokens: int64 x token count
    payload: the block's KV, [layers, 2, block_size, kv_heads, head_dim] as stored

and the checksum covers the header fields, the tokens and the payload. A read checks all of it
and the tokens the caller expects; anything short, corrupt or foreign is a miss (and the file is
removed), never KV. Files are written to a temporary name and renamed, so a crash leaves no
half-written entry under a real name.

The index (key -> size, LRU order) lives in memory and is only touched by the engine thread; the
file I/O runs on the copy worker (`engine/kv/transfer.py`), whose FIFO order keeps a delete, a
write and a read of one key in the order they were decided. Never holds KV in memory itself.
"""
from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

MAGIC = b"CUTTLEKV"
FORMAT = 1
_HEADER = struct.Struct("<8sIQQIQ")  # magic, format, namespace, key, n_tokens, payload bytes
_SUM = struct.Struct("<Q")


def namespace_key(*parts: bytes) -> int:
    h = xxhash.xxh3_64(b"cuttle-kv-namespace")
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.intdigest()


def checkpoint_fingerprint(path: str) -> bytes:
    """xxh3-128 of config.json and every weight file's name and bytes: a different checkpoint
    (or the same one re-trained and saved in place) never shares disk entries with this one."""
    h = xxhash.xxh3_128(b"cuttle-checkpoint")
    names = sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith((".safetensors", ".bin", ".pt")))
    for name in names:
        h.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.digest()


class DiskTier:
    def __init__(self, root: str, capacity_bytes: int, entry_bytes: int, block_size: int):
        self.file_bytes = _HEADER.size + _SUM.size + 8 * block_size + entry_bytes
        if capacity_bytes < self.file_bytes:
            raise ValueError(f"kv_cache_dir_gb ({capacity_bytes / 2**30:.6f} GiB) holds not even one block ({self.file_bytes} bytes)")
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.entry_bytes = entry_bytes  # payload bytes of one block
        self.namespace = 0
        self.entries: OrderedDict[int, int] = OrderedDict()  # key -> file bytes, least recent first
        self._others: OrderedDict[str, int] = OrderedDict()  # files of other namespaces: path -> bytes
        self.used_bytes = 0
        os.makedirs(root, exist_ok=True)
        self._scan()

    # ---- the index (engine thread) ---------------------------------------------------------
    def _dir(self, namespace: int) -> str:
        return os.path.join(self.root, f"{namespace:016x}")

    def path(self, key: int, namespace: int | None = None) -> str:
        return os.path.join(self._dir(self.namespace if namespace is None else namespace), f"{key:016x}.kv")

    def _scan(self) -> None:
        """Every entry on disk, oldest first, counted against the capacity: files of other
        namespaces are never hit but age out like the rest. Leftover temporary files go."""
        found: list[tuple[int, str, int]] = []
        for ns in os.listdir(self.root):
            d = os.path.join(self.root, ns)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                p = os.path.join(d, name)
                if not name.endswith(".kv"):
                    _remove(p)
                    continue
                st = os.stat(p)
                found.append((st.st_mtime_ns, p, st.st_size))
        found.sort()
        self._others = OrderedDict((p, size) for _, p, size in found)
        self.used_bytes = sum(size for _, _, size in found)

    def set_namespace(self, namespace: int) -> None:
        """Switch to the entries of `namespace` (at start, and after a weight update): the index
        then holds only what may be hit; everything else is in the age-out list."""
        for key, size in self.entries.items():
            self._others[self.path(key)] = size
        self.entries.clear()
        self.namespace = namespace
        d = self._dir(namespace)
        os.makedirs(d, exist_ok=True)
        for p in [p for p in self._others if os.path.dirname(p) == d]:
            name = os.path.basename(p)
            try:
                key = int(name[:-3], 16)
            except ValueError:
                continue
            self.entries[key] = self._others.pop(p)

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def touch(self, key: int) -> None:
        self.entries.move_to_end(key)

    def reserve(self, key: int) -> list[str]:
        """Count an entry about to be written; returns the files to delete first (least recent,
        other namespaces' before this one's) so the total stays within the capacity."""
        size = self.file_bytes
        victims: list[str] = []
        while self.used_bytes + size > self.capacity_bytes and (self._others or self.entries):
            if self._others:
                p, s = self._others.popitem(last=False)
            else:
                k, s = self.entries.popitem(last=False)
                p = self.path(k)
            victims.append(p)
            self.used_bytes -= s
        self.entries[key] = size
        self.used_bytes += size
        return victims

    def forget(self, key: int) -> None:
        """A read found the entry unusable (the worker removed the file)."""
        size = self.entries.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    # ---- file I/O (copy worker) ------------------------------------------------------------
    def write(self, key: int, namespace: int, tokens: Sequence[int], payload: np.ndarray, victims: list[str]) -> int:
        for p in victims:
            _remove(p)
        toks = np.asarray(tokens, dtype=np.int64).tobytes()
        data = np.ascontiguousarray(payload).tobytes()
        header = _HEADER.pack(MAGIC, FORMAT, namespace, key, len(tokens), len(data))
        checksum = xxhash.xxh3_64(header + toks + data).intdigest()
        final = self.path(key, namespace)
        tmp = final + f".{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(_SUM.pack(checksum))
            f.write(toks)
            f.write(data)
        os.replace(tmp, final)
        return len(header) + _SUM.size + len(toks) + len(data)

    def read(self, key: int, namespace: int, tokens: Sequence[int]) -> bytes | None:
        """The payload, or None if the file is missing, short, corrupt, another entry's, or holds
        other tokens (a corrupt file is removed)."""
        p = self.path(key, namespace)
        try:
            with open(p, "rb") as f:
                blob = f.read()
        except OSError:
            return None
        n_head = _HEADER.size + _SUM.size
        ok = False
        if len(blob) >= n_head:
            magic, fmt, ns, k, n_tok, n_data = _HEADER.unpack_from(blob)
            (checksum,) = _SUM.unpack_from(blob, _HEADER.size)
            body = blob[n_head:]
            ok = (magic == MAGIC and fmt == FORMAT and ns == namespace and k == key and n_data == self.entry_bytes
                  and len(body) == 8 * n_tok + n_data
                  and xxhash.xxh3_64(blob[: _HEADER.size] + body).intdigest() == checksum)
        if not ok:
            _remove(p)
            return None
        if np.frombuffer(body[: 8 * n_tok], dtype=np.int64).tolist() != list(tokens):
            return None  # a hash collision: the file is someone else's, and fine
        os.utime(p)  # LRU order survives a restart through the mtime
        return body[8 * n_tok :]


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
