"""Pure-Python stand-ins for standard modules that benchmark code imports but the sandbox
does not preload.

The verifier's zygote preloads only the modules training programs may use (a chrooted
child cannot import anything from disk), so `import hashlib` in HumanEval/162 fails there.
`with_shims` prepends a tiny implementation of such a module, registered in
`sys.modules`, to programs that mention it; isolation is unchanged (it is ordinary code
running inside the same sandbox). Only what the benchmarks use is provided.
"""

from __future__ import annotations

# RFC 1321 MD5, enough for `hashlib.md5(data).hexdigest()`.
_HASHLIB = r'''
import sys as _populora_sys
if "hashlib" not in _populora_sys.modules:
    def _populora_hashlib():
        import math
        shifts = [7, 12, 17, 22] * 4 + [5, 9, 14, 20] * 4 + [4, 11, 16, 23] * 4 + [6, 10, 15, 21] * 4
        table = [int(abs(math.sin(i + 1)) * 2 ** 32) & 0xFFFFFFFF for i in range(64)]
        mask = 0xFFFFFFFF

        class md5:
            name, digest_size, block_size = "md5", 16, 64

            def __init__(self, data=b"", **_):
                self._data = b""
                self.update(data)

            def update(self, data):
                self._data += bytes(data)

            def copy(self):
                return md5(self._data)

            def digest(self):
                msg = bytearray(self._data)
                bits = (len(msg) * 8) & 0xFFFFFFFFFFFFFFFF
                msg.append(0x80)
                while len(msg) % 64 != 56:
                    msg.append(0)
                msg += bits.to_bytes(8, "little")
                h = [0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476]
                for off in range(0, len(msg), 64):
                    words = [int.from_bytes(msg[off + 4 * j:off + 4 * j + 4], "little") for j in range(16)]
                    a, b, c, d = h
                    for i in range(64):
                        if i < 16:
                            f, g = (b & c) | (~b & d), i
                        elif i < 32:
                            f, g = (d & b) | (~d & c), (5 * i + 1) % 16
                        elif i < 48:
                            f, g = b ^ c ^ d, (3 * i + 5) % 16
                        else:
                            f, g = c ^ (b | ~d), (7 * i) % 16
                        f = (f + a + table[i] + words[g]) & mask
                        a, d, c = d, c, b
                        b = (b + ((f << shifts[i]) | (f >> (32 - shifts[i])))) & mask
                    h = [(x + y) & mask for x, y in zip(h, (a, b, c, d))]
                return b"".join(x.to_bytes(4, "little") for x in h)

            def hexdigest(self):
                return self.digest().hex()

        module = type(_populora_sys)("hashlib")
        module.md5 = md5
        module.algorithms_available = module.algorithms_guaranteed = frozenset({"md5"})
        return module
    _populora_sys.modules["hashlib"] = _populora_hashlib()
    del _populora_hashlib
'''

SHIMS = {"hashlib": _HASHLIB}


def with_shims(program: str) -> str:
    """`program` preceded by the shim of every unpreloaded module whose name it mentions."""
    prelude = "".join(src for name, src in SHIMS.items() if name in program)
    return prelude + program if prelude else program
