"""Write a copy of a nixl wheel without the parts pd-serve's nixl backend never loads (the
nixl_ep expert-parallel modules, example scripts, UCX's perftest and the non-UCX plugins), so
it fits a device run's 64 MiB: nixl-cu13 1.5.1 goes from 58.8 MB to 23.7 MB.

    python scripts/trim_nixl_wheel.py nixl_cu13-1.5.1-cp312-...whl .whl-nixl/
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

DROP = re.compile(r"^(nixl_ep_cu\d+/|nixl_cu\d+\.scripts/|.*libucx_perftest|.*libplugin_(GPUNETIO|"
                  r"INFINIA|GUSLI|LIBFABRIC|OBJ|AZURE_BLOB|GDS|GDS_MT|HF3FS|POSIX|MOONCAKE|UCCL)\b)")


def main(src: str, out_dir: str) -> None:
    dst = Path(out_dir) / Path(src).name
    dst.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if DROP.match(info.filename):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith("/RECORD"):  # the dropped files leave RECORD too
                lines = [line for line in data.decode().splitlines() if not DROP.match(line)]
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(info, data)
    print(f"{dst}: {dst.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main(*sys.argv[1:3])
