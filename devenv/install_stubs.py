"""Put devenv/cpu_stubs on the CPU venv's sys.path (a .pth file); never used outside that venv."""

import sysconfig
from pathlib import Path

stubs = Path(__file__).resolve().parent / "cpu_stubs"
pth = Path(sysconfig.get_paths()["purelib"]) / "sglang_ext_cpu_stubs.pth"
pth.write_text(f"{stubs}\n")
print(f"CPU import stand-ins: {pth} -> {stubs}")
