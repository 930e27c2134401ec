"""kubernetes-asyncio without its generated models: the parts gpulet uses, ~36 MB less.

gpulet uses kubernetes-asyncio's ``ApiClient``, ``Configuration`` and config loaders,
and reads and writes raw JSON: never the ~700 generated model and API classes. But
``import kubernetes_asyncio.client.api_client`` runs the package's ``__init__`` files
first, and they import every one of those classes: about 40 MB of RSS that a reporter or
allocator sidecar keeps for its whole life, to use none of it (measured: 73 MB for
``import kubernetes_asyncio`` against 40 MB for the modules gpulet uses, aiohttp and
PyYAML included).

:func:`prepare` registers the four packages (``kubernetes_asyncio``, ``.client``,
``.client.models``, ``.config``) as *lazy* packages before anything imports them: their
submodules import as usual, but a package's own ``__init__`` runs only when someone
asks the package for a name it does not have yet (``kubernetes_asyncio.client.CoreV1Api``,
``kubernetes_asyncio.config.load_kube_config``). Then it runs in full, once, and that
caller gets exactly what a plain import would have given. So nothing that uses the
library the ordinary way breaks; the sidecars simply never ask.

Nothing of the library is replaced or copied: only *when* its package initialisers run
changes. A process that imported ``kubernetes_asyncio`` before :func:`prepare` keeps
the ordinary package (then this does nothing).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Final

PACKAGES: Final = (
    "kubernetes_asyncio",
    "kubernetes_asyncio.client",
    "kubernetes_asyncio.client.models",
    "kubernetes_asyncio.config",
)


class _LazyPackage(types.ModuleType):
    """A package whose ``__init__`` runs on the first lookup of a name it lacks."""

    _gpulet_init: str = ""

    def __getattr__(self, name: str) -> Any:
        init = self.__dict__.get("_gpulet_init")
        if not init or name.startswith("__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        # A submodule (``from kubernetes_asyncio.client import rest`` asks for one this
        # way) is imported on its own; only other names need the package's __init__.
        here = Path(init).parent
        if (here / f"{name}.py").is_file() or (here / name / "__init__.py").is_file():
            return importlib.import_module(f"{self.__name__}.{name}")
        self.__dict__["_gpulet_init"] = ""  # once, even if it raises
        code = compile(Path(init).read_bytes(), init, "exec")
        exec(code, self.__dict__)
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None


def prepare() -> bool:
    """Register the lazy packages; False when the library was imported already (or is
    not installed), True when they are in place."""
    if PACKAGES[0] in sys.modules:
        return isinstance(sys.modules[PACKAGES[0]], _LazyPackage)
    spec = importlib.util.find_spec(PACKAGES[0])
    if spec is None or spec.origin is None:
        return False
    root = Path(spec.origin).parent
    for name in PACKAGES:
        directory = root.joinpath(*name.split(".")[1:])
        package = _LazyPackage(name)
        package.__path__ = [str(directory)]
        package.__file__ = str(directory / "__init__.py")
        package.__package__ = name
        package._gpulet_init = str(directory / "__init__.py")
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, package)
    # The two names the config loaders take from the client package (``from
    # kubernetes_asyncio.client import ApiClient, Configuration``), from their modules.
    from kubernetes_asyncio.client.api_client import ApiClient
    from kubernetes_asyncio.client.configuration import Configuration

    client = sys.modules["kubernetes_asyncio.client"]
    client.__dict__.update(ApiClient=ApiClient, Configuration=Configuration)
    return True
