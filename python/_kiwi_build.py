"""A PEP 517 build backend in the standard library only, for the `kiwi` package.

`pip install ./python` builds a wheel with it in an isolated environment that needs
nothing installed (`requires = []`), so installing works offline. It packs `kiwi/*.py`
into a `py3-none-any` wheel; there is no sdist.
"""

import base64
import hashlib
import os
import zipfile

NAME = "kiwi_gpu"
DIST = "kiwi-gpu"
VERSION = "0.1.0"
HERE = os.path.dirname(os.path.abspath(__file__))
TAG = "py3-none-any"


def _metadata():
    return (
        "Metadata-Version: 2.1\n"
        f"Name: {DIST}\n"
        f"Version: {VERSION}\n"
        "Summary: See Kiwi's GPU sharing from inside a Python process or notebook\n"
        "License: Apache-2.0\n"
        "Requires-Python: >=3.8\n"
    )


def _wheel_file():
    return f"Wheel-Version: 1.0\nGenerator: _kiwi_build\nRoot-Is-Purelib: true\nTag: {TAG}\n"


def _files():
    pkg = os.path.join(HERE, "kiwi")
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                yield f"kiwi/{name}", f.read()


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}\n"


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = f"{NAME}-{VERSION}.dist-info"
    os.makedirs(os.path.join(metadata_directory, info), exist_ok=True)
    with open(os.path.join(metadata_directory, info, "METADATA"), "w") as f:
        f.write(_metadata())
    with open(os.path.join(metadata_directory, info, "WHEEL"), "w") as f:
        f.write(_wheel_file())
    return info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    info = f"{NAME}-{VERSION}.dist-info"
    wheel = f"{NAME}-{VERSION}-{TAG}.whl"
    entries = list(_files())
    entries.append((f"{info}/METADATA", _metadata().encode()))
    entries.append((f"{info}/WHEEL", _wheel_file().encode()))
    record = "".join(_record_line(p, d) for p, d in entries) + f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode()))
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in entries:
            z.writestr(path, data)
    return wheel
