"""The docs name what exists: every file path, cupycoll name and test that README.md,
docs/*.md and bench/README.md name is in this checkout, and every relative link resolves (to
a file, and to a heading of it when it names one).

Read from the files and resolved for real: a path with ``os.path.exists`` (a glob must match
something), a dotted name by importing its module and ``getattr`` (an attribute only an
instance has counts when the class's source assigns ``self.<name>``), a test cited as
``file.py::test_name`` by finding the file under tests/ and its ``def``. A rename or a move
that leaves a doc behind fails here, naming the doc and the name.

What counts as a name of cupycoll's, so that torch's, NCCL's and a variable's are left alone:
a code span that is a whole dotted name (a call's arguments dropped) starting with
``cupycoll``, with a cupycoll module's own name (``lifecycle.GroupLifetime``, ``nccl.bootstrap``)
or with a class a cupycoll or benchmark module defines (``CudaBackend.submit``). Module
names two modules share (``group``: trace's and nccl's) and a variable's name are not
resolved; ``nccl.`` followed by anything but a module of cupycoll/nccl/ is NCCL's or
nccl4py's own.

Left out: bare file names (``backend.py`` may be torch's, in the comparison with nccl4py),
names outside code spans, and whether the prose about a name is still true.
"""

from __future__ import annotations

import glob
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A path of the checkout: starts with one of its top folders, not inside a URL or a longer
# path; a link's anchor is not part of it.
_PATH = re.compile(r"(?<![\w/.\-])((?:cupycoll|bench|tools|examples|tests|docs|\.ci)/[^\s`'\"()\[\],;|#]*)")
_SPAN = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_NODE = re.compile(r"\b((?:[\w/]+/)?test_\w+\.py)::(\w+)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A span's last part that makes it a file name, not an attribute.
_SUFFIXES = {"py", "md", "cu", "cuh", "hpp", "json", "csv", "png", "gz", "toml", "txt", "log", "so", "sh"}


def _spans(text: str) -> Iterator[str]:
    for match in _SPAN.finditer(text):
        yield re.sub(r"\(.*\)$", "", match.group(1).strip())  # a call: the name called


def doc_paths(text: str) -> Set[str]:
    """The checkout paths a doc names (placeholders such as ``<date>`` left out)."""
    found = set()
    for match in _PATH.finditer(text):
        path = match.group(1).rstrip(".:")
        if not re.search(r"[<>${}]", path):
            found.add(path)
    return found


def missing_paths(paths: Set[str], root: Path = ROOT) -> List[str]:
    return sorted(p for p in paths
                  if not (glob.glob(str(root / p)) if "*" in p else (root / p).exists()))


def doc_names(text: str) -> Set[str]:
    """The whole-span dotted names of a doc (file names left out)."""
    return {span for span in _spans(text)
            if _DOTTED.fullmatch(span) and span.rsplit(".", 1)[1] not in _SUFFIXES}


def doc_tests(text: str) -> Set[Tuple[str, str]]:
    """The tests a doc cites as ``file.py::test_name``."""
    return set(_NODE.findall(text))


def doc_links(text: str) -> Set[str]:
    """The relative link targets of a doc, with their anchors (``file.md#part``, ``#part``)."""
    return {link for link in _LINK.findall(text) if not re.match(r"[a-z]+:", link)}


def anchors(text: str) -> Set[str]:
    """The anchors a Markdown file's headings get (GitHub's rule: lower case, punctuation
    dropped, spaces to hyphens)."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", text, re.M)}


def broken_links(path: Path) -> List[str]:
    """The relative links of a doc whose file, or whose anchor in it, does not exist."""
    broken = []
    for link in doc_links(path.read_text(encoding="utf-8")):
        target, _, anchor = link.partition("#")
        file = (path.parent / target) if target else path
        if not file.exists():
            broken.append(link)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            broken.append(link)
    return sorted(broken)


# ------------------------------------------------------------------------ name resolution


class Namespace:
    """cupycoll's modules and classes (and the benchmark's), imported, by the names docs use."""

    def __init__(self):
        from cupycoll.errors import MissingDependencyError

        self.modules: Dict[str, List[str]] = {}  # short or dotted tail -> full module names
        self.classes: Dict[str, List[type]] = {}
        for package in ("cupycoll", "bench"):
            root = importlib.import_module(package)
            names = [package] + [info.name for info in pkgutil.walk_packages(root.__path__, package + ".")
                                 if not info.name.endswith(".__main__")]  # running it is its import
            for full in names:
                try:
                    module = importlib.import_module(full)
                except MissingDependencyError:  # an optional integration whose framework is absent
                    continue
                parts = full.split(".")
                for start in range(1, len(parts)):
                    self.modules.setdefault(".".join(parts[start:]), []).append(full)
                for value in vars(module).values():
                    if inspect.isclass(value) and value.__module__ == full:
                        self.classes.setdefault(value.__name__, []).append(value)

    def resolve(self, name: str) -> Optional[bool]:
        """True: the name exists; False: it names a cupycoll module or class and the rest is
        missing; None: not a name of cupycoll's (torch's, a variable's, ambiguous)."""
        parts = name.split(".")
        if parts[0] == "cupycoll":
            return _lookup(["cupycoll"], parts[1:])
        if parts[0] == "nccl" and "cupycoll.nccl." + parts[1] not in self.modules.get(parts[1], []):
            return None  # NCCL's or nccl4py's own ``nccl`` (nccl.core, nccl.AVG)
        for length in range(len(parts) - 1, 0, -1):  # the longest module tail first
            modules = self.modules.get(".".join(parts[:length]))
            if modules:
                if len({m for m in modules if m.startswith("cupycoll")}) > 1:
                    return None  # ``group``: trace's or nccl's; docs say which
                return any(_lookup(m.split("."), parts[length:]) for m in modules)
        if parts[1] in self.classes:
            return False  # a class of cupycoll's under a module it is not in (``group_trace.GroupTrace``)
        classes = self.classes.get(parts[0])
        if classes:
            return any(_has(cls, parts[1:]) for cls in classes)
        return None


def _lookup(module_parts: List[str], attributes: List[str]) -> bool:
    # the longest importable module first, then attributes
    from cupycoll.errors import MissingDependencyError

    for split in range(len(attributes), -1, -1):
        try:
            value = importlib.import_module(".".join(module_parts + attributes[:split]))
        except MissingDependencyError:  # an optional integration: there, its framework absent here
            return True
        except ImportError:
            continue
        return _has(value, attributes[split:])
    return False


def _has(value, attributes: List[str]) -> bool:
    for attribute in attributes:
        if hasattr(value, attribute):
            value = getattr(value, attribute)
        elif inspect.isclass(value) and _instance_attribute(value, attribute):
            return True  # nothing further can be resolved on an instance attribute
        else:
            return False
    return True


def _instance_attribute(cls: type, attribute: str) -> bool:
    for klass in cls.__mro__:
        if getattr(klass, "__module__", "").split(".")[0] not in ("cupycoll", "bench"):
            continue
        fields = getattr(klass, "__dataclass_fields__", {})
        if attribute in fields or re.search(rf"\bself\.{re.escape(attribute)}\s*(:[^=]*)?=",
                                            inspect.getsource(klass)):
            return True
    return False


def defined_tests(tests_dir: Path = ROOT / "tests") -> Dict[str, Set[str]]:
    """test file name -> the functions it defines, for every test file under tests/."""
    found: Dict[str, Set[str]] = {}
    for path in tests_dir.rglob("test_*.py"):
        text = path.read_text(encoding="utf-8")
        found.setdefault(path.name, set()).update(re.findall(r"^\s*def (test_\w+)", text, re.M))
    return found


# ------------------------------------------------------------------------------- checks


@pytest.fixture(scope="module")
def namespace() -> Namespace:
    return Namespace()


def _docs() -> Iterator[Tuple[str, str]]:
    for path in DOCS:
        yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")


def unresolved(text: str, namespace: Namespace) -> List[str]:
    return sorted(name for name in doc_names(text) if namespace.resolve(name) is False)


def uncited(text: str, tests: Dict[str, Set[str]]) -> List[str]:
    return sorted(f"{file}::{name}" for file, name in doc_tests(text)
                  if name not in tests.get(Path(file).name, set()))


def test_every_path_a_doc_names_exists():
    missing = {doc: missing_paths(doc_paths(text)) for doc, text in _docs()}
    assert {doc: paths for doc, paths in missing.items() if paths} == {}


def test_every_cupycoll_name_a_doc_names_exists(namespace):
    missing = {doc: unresolved(text, namespace) for doc, text in _docs()}
    assert {doc: names for doc, names in missing.items() if names} == {}


def test_every_test_a_doc_cites_is_defined():
    tests = defined_tests()
    missing = {doc: uncited(text, tests) for doc, text in _docs()}
    assert {doc: names for doc, names in missing.items() if names} == {}


def test_every_relative_link_of_a_doc_resolves_to_a_file_and_heading():
    missing = {str(path.relative_to(ROOT)): broken_links(path) for path in DOCS}
    assert {doc: links for doc, links in missing.items() if links} == {}


# ---------------------------------------------- drift is caught, other projects' names are not


def test_a_moved_module_a_renamed_name_and_a_gone_test_are_caught(namespace, tmp_path):
    text = ("`cupycoll/kernels/*.cu*` and `cupycoll/faults/lifecycle.py`; `lifecycle.GroupLifetime` "
            "and `lifecycle.GroupLifetimes`; `cupycoll.Options(timeout=5)` and `cupycoll.Option`; "
            "`faults.watchdog.Watch`; `nccl.bootstrap.StoreBootstrap` and `nccl.bootstrap.Bootstrap`; "
            "`group_trace.GroupTrace.call`; "
            "`Issuer.issue` and `Issuer.isue`; "
            "`test_faults.py::test_abort_all_reaches_every_live_group`, `test_faults.py::test_gone`")
    assert missing_paths(doc_paths(text)) == ["cupycoll/kernels/*.cu*"]
    assert unresolved(text, namespace) == ["Issuer.isue", "cupycoll.Option", "group_trace.GroupTrace.call",
                                           "lifecycle.GroupLifetimes", "nccl.bootstrap.Bootstrap"]
    assert uncited(text, defined_tests()) == ["test_faults.py::test_gone"]


def test_names_of_torch_nccl_and_variables_are_not_cupycolls(namespace):
    text = ("`torch.distributed.DistBackendError`, `dist.shrink_group`, `nccl.core`, `nccl.AVG`, "
            "`group.abort()`, `store.wait`, `recorder.py`, `_watchdog._Watchdog`, "
            "<https://github.com/cupycoll/cupycoll/blob/main/README.md>, `bench/results/sweep-<gpu>.json`")
    assert unresolved(text, namespace) == []
    assert {namespace.resolve(name) for name in doc_names(text)} == {None}
    assert doc_paths(text) == set()


def test_a_link_to_a_gone_file_or_heading_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Two shapes: `a`, b\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](other.md#two-shapes-a-b) [b](other.md#two-shapes) [c](gone.md) [d](#here) "
                   "[e](https://example.com/x.md) [f](#other)\n\n## Here\n")
    assert broken_links(doc) == ["#other", "gone.md", "other.md#two-shapes"]


def test_an_instance_attribute_counts_and_a_made_up_one_does_not(namespace):
    assert namespace.resolve("CudaBackend.settings") is True  # set in __init__
    assert namespace.resolve("CudaBackend.no_such_attribute") is False


def test_the_sizes_and_call_counts_the_docs_quote_are_the_tools():
    # Figures that move with the code are read from the tools that measure them, not typed.
    from tools import call_path, size

    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = size.measure()
    assert f"About {size.about(lines['lines'])} lines of Python" in readme
    assert f"**about {size.about(lines['lines'])} lines**, no module over {size.MODULE_LINES} lines" in design
    assert lines["over_limit"] == {}  # a module past the limit is split by what it does
    path = call_path.measure(20)
    assert (f"**{path['calls']} calls in {path['modules']} modules, {path['cross_module_calls']} across modules, "
            f"none upward**") in design
    assert f"every call (an algorithm override in force), {path['general_calls']} calls;" in design
    assert f"**{path['block_calls']} calls**, none per part" in design
