"""The package layout holds: torch-free bookkeeping, one dependency direction, no cycles, no private
reach-ins across sub-packages, each shared limit defined once, and a docstring on every module.

Everything but the first test reads the modules' source with `ast`, so imports inside functions
count as much as those at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_paged.transformers_api import private_names

PACKAGE = Path(__file__).resolve().parents[1] / "hf_paged"

# The serving stack, bottom to top: a sub-package may import only those before it (and itself).
CHAIN = ["core", "attention", "hf", "structured", "worker", "spec_decode", "engine", "integrations"]
# The fronts, side by side above the chain: each may import the whole chain, none imports another, and
# nothing in the chain imports them. `serve` (HTTP) fronts any `engine.EngineClient`: an `AsyncEngine`,
# or `disagg`'s async client, which only the package front (`cli`) hands it; `parallel` starts tensor-parallel
# ranks, which `cli` hands the server too.
FRONTS = ["disagg", "serve", "parallel"]
# They stand apart: nothing of the chain imports them, and they import only the leaf `config`
# (`defaults` uses the package only through transformers' public `attn_implementation` flag).
APART = ["planner", "defaults"]
# Import only each other; anyone may import them.
LEAVES = {"config", "kv_spec", "kv_layout", "state_spec", "text", "sampling_params", "structured_outputs", "model_source",
          "optional", "transformers_api"}
TOP = {"__init__", "cli"}  # the public front: may import anything, imported by nobody below


def _modules() -> dict[str, Path]:
    """Dotted name relative to hf_paged (`engine.engine`, `config`) -> path."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]  # a package is named by its folder; hf_paged itself is ""
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, top_level_only: bool = False) -> list[tuple[str, list[str], int]]:
    """(imported hf_paged module relative to the package, names taken from it, line) per import."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    parts = name.split(".") if name else []
    here = parts if _is_package(path) else parts[:-1]  # the module's own package
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "hf_paged" or alias.name.startswith("hf_paged."):
                    found.append((alias.name.removeprefix("hf_paged").lstrip("."), [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "hf_paged" or node.module.startswith("hf_paged.")):
                target = node.module.removeprefix("hf_paged").lstrip(".")
            else:
                continue
            found.append((target, [a.name for a in node.names], node.lineno))
    return found


def _room(module: str) -> str:
    """The sub-package (or top-level module) a dotted module name lives in; "" is hf_paged itself."""
    return module.split(".")[0] if module else "__init__"


def _all_edges(top_level_only: bool = False):
    for name, path in _modules().items():
        for target, names, line in _imports(name, path, top_level_only):
            yield name, path, target, names, line


def test_core_imports_with_torch_unavailable():
    """`hf_paged.core` needs neither torch nor transformers. The parent package is stubbed so that its
    `__init__` (which registers the attention with transformers) does not run; everything `core`
    imports is then loaded for real, with torch and transformers unimportable."""
    script = textwrap.dedent(f"""
        import sys, types
        for blocked in ("torch", "transformers", "numpy", "triton"):
            sys.modules[blocked] = None  # `import torch` now raises ImportError
        parent = types.ModuleType("hf_paged")
        parent.__path__ = [{str(PACKAGE)!r}]
        sys.modules["hf_paged"] = parent
        import hf_paged.core as core
        from hf_paged.core import BlockManager, BlockPool, Request, Scheduler

        pool = BlockPool(8)
        manager = BlockManager(pool, block_size=4)
        scheduler = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=16)
        seq = core.KVSequence(seq_id=1)
        scheduler.add(Request(request_id="a", token_ids=list(range(10)), num_prompt_tokens=10,
                              max_total_tokens=12, seq=seq))
        out = scheduler.schedule()
        assert [len(e.token_ids) for e in out.scheduled] == [10], out
        pool.check_invariants()
        loaded = sorted(m for m in sys.modules if m.startswith("hf_paged"))
        assert not [m for m in ("torch", "transformers") if sys.modules.get(m) is not None]
        print(" ".join(loaded))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    assert "hf_paged.core.scheduler" in loaded and "hf_paged.core.block_pool" in loaded
    leaves = ("hf_paged.core", "hf_paged.config", "hf_paged.kv_spec", "hf_paged.kv_layout", "hf_paged.state_spec")
    assert all(m == "hf_paged" or m.startswith(leaves) for m in loaded), loaded


def test_the_stub_really_blocks_torch():
    """The check above can fail: with the same stub, a module that needs torch does not import."""
    script = textwrap.dedent(f"""
        import sys, types
        sys.modules["torch"] = None
        parent = types.ModuleType("hf_paged")
        parent.__path__ = [{str(PACKAGE)!r}]
        sys.modules["hf_paged"] = parent
        import hf_paged.hf.padding
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr


def _direction_violation(src: str, dst: str) -> str | None:
    """Why an import from room `src` of room `dst` breaks the layout, or None if it is allowed."""
    rank = {room: i for i, room in enumerate(CHAIN)} | {room: len(CHAIN) for room in FRONTS}
    if src in LEAVES and dst not in LEAVES:
        return f"{src} must stay a leaf"
    if src == dst or dst in LEAVES:
        return None
    if dst in TOP:
        return None if src in TOP else "sub-packages never import the package front"
    if src in TOP:
        return None
    if src in APART or dst in APART:
        return f"{src} -> {dst}: planner and defaults stand apart"
    if src in FRONTS and dst in FRONTS:
        return f"{src} -> {dst}: the fronts {', '.join(FRONTS)} never import each other"
    if rank[dst] > rank[src]:
        return f"{src} -> {dst} points up the chain {' <- '.join(CHAIN)} <- {{{', '.join(FRONTS)}}}"
    return None


def test_one_dependency_direction():
    bad = []
    for name, path, target, _, line in _all_edges():
        why = _direction_violation(_room(name), _room(target))
        if why:
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports hf_paged.{target or '(package)'} ({why})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("src,dst", [("core", "attention"), ("engine", "integrations"), ("hf", "worker"),
                                     ("planner", "engine"), ("engine", "defaults"), ("config", "core"),
                                     ("worker", "__init__"), ("serve", "disagg"), ("disagg", "serve"),
                                     ("engine", "disagg"), ("integrations", "serve"), ("model_source", "engine")])
def test_the_direction_rule_rejects(src, dst):
    assert _direction_violation(src, dst) is not None


@pytest.mark.parametrize("src,dst", [("attention", "core"), ("integrations", "core"), ("planner", "config"),
                                     ("__init__", "engine"), ("spec_decode", "worker"), ("disagg", "engine"),
                                     ("serve", "integrations"), ("disagg", "core"), ("disagg", "model_source"),
                                     ("__init__", "disagg")])
def test_the_direction_rule_allows(src, dst):
    assert _direction_violation(src, dst) is None


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles_between_sub_packages():
    graph: dict[str, set[str]] = {}
    for name, _, target, _, _ in _all_edges():
        src, dst = _room(name), _room(target)
        if src != dst and src not in TOP:
            graph.setdefault(src, set()).add(dst)
    assert _find_cycle(graph) is None, f"sub-package import cycle: {_find_cycle(graph)}"


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "with-lazy-imports"])
def test_no_module_import_cycles(top_level_only):
    """No module imports itself back, counting the imports inside functions too: a lazy import only
    hides a cycle from the interpreter, not from the design."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target, names, _ in _imports(name, path, top_level_only=top_level_only):
            # `from .pkg import mod` names a module; `from .mod import f` names the module itself.
            deps = [f"{target}.{n}" if f"{target}.{n}" in modules else target for n in names] or [target]
            graph.setdefault(name, set()).update(d for d in deps if d in modules and d != name)
    # A package's __init__ importing its own modules is how packages work, not a cycle back up.
    for name in list(graph):
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".") and d != ""}
    assert _find_cycle(graph) is None, f"module import cycle: {_find_cycle(graph)}"


def test_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_private_names_imported_across_sub_packages():
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} takes {n} from hf_paged.{target}"
           for name, path, target, names, line in _all_edges()
           for n in names if n.startswith("_") and n != "__version__" and _room(name) != _room(target)]
    assert not bad, "\n".join(bad)


# Private attributes of transformers and torch objects that hf_paged reads on purpose: one list, with what
# uses each and the releases it was checked on (`hf_paged.transformers_api`).
FOREIGN_PRIVATES = private_names()


def test_no_private_attribute_reach_ins():
    """`x._name` only on `self` / `cls`: another object's private state (`self.scheduler._preempt`,
    `engine._requests`) needs a public operation instead."""
    bad = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in FOREIGN_PRIVATES:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


SHARED_LIMITS = ("DEFAULT_BLOCK_SIZE", "MAX_DECODE_QUERY_LEN", "MAX_SPECULATIVE_TOKENS")


@pytest.mark.parametrize("limit", SHARED_LIMITS)
def test_each_shared_limit_is_defined_once(limit):
    defined = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == limit for t in targets):
                defined.append(name)
    assert defined == ["config"], defined


def test_every_module_says_what_it_owns():
    missing = [name or "hf_paged" for name, path in _modules().items()
               if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()]
    assert not missing, missing


def test_tests_mirror_the_sub_packages():
    tests = Path(__file__).resolve().parent
    rooms = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(CHAIN + FRONTS + APART)
    missing = [room for room in rooms if not list((tests / room).glob("test_*.py"))]
    assert not missing, f"no tests/<room>/test_*.py for {missing}"


def test_every_internal_import_resolves():
    """Lazy imports inside functions only fail when called: check each one names a real module."""
    modules = _modules()
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports hf_paged.{target}"
           for _, path, target, _, line in _all_edges() if target and target not in modules]
    assert not bad, "\n".join(bad)


MAX_FILE_LINES = 700
MAX_CLASS_LINES = 500


def test_no_file_or_class_outgrows_its_room():
    """A file over 700 lines or a class over 500 holds more than one job: split it by responsibility
    (the engine's front, core, output processing and KV owner are the model)."""
    bad = []
    for name, path in _modules().items():
        source = path.read_text()
        num_lines = source.count("\n") + 1
        if num_lines > MAX_FILE_LINES:
            bad.append(f"{path.relative_to(PACKAGE.parent)}: {num_lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} class {node.name}: "
                           f"{node.end_lineno - node.lineno + 1} lines")
    assert not bad, "\n".join(bad)


def test_serve_uses_no_torch_distributed():
    """The HTTP server fronts an `EngineClient`; process groups, stores and K/V transfers are `disagg`'s
    (so `serve` runs, and is tested, without a process group)."""
    bad = []
    for name, path in _modules().items():
        if _room(name) != "serve":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(m == "torch.distributed" or m.startswith("torch.distributed.") for m in modules):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bad, "\n".join(bad)


def test_the_disaggregated_router_imports_with_torch_unavailable():
    """`disagg.router` is bookkeeping like `core`, whose block hash chain it keys affinity with."""
    script = textwrap.dedent(f"""
        import sys, types
        for blocked in ("torch", "transformers", "numpy", "triton"):
            sys.modules[blocked] = None
        for name, folder in (("hf_paged", ""), ("hf_paged.disagg", "disagg")):
            stub = types.ModuleType(name)
            stub.__path__ = [{str(PACKAGE)!r} + ("/" + folder if folder else "")]
            sys.modules[name] = stub
        from hf_paged.core import hash_block_tokens
        from hf_paged.disagg.router import Router

        router = Router(["p0"], ["d0"], block_size=2)
        assert router.block_chain([1, 2, 3, 4, 5]) == [hash_block_tokens(None, [1, 2]),
                                                       hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])]
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# The engine's defaults (`config.EngineConfig`): each is a literal in one place, config.py; everything
# else (the Engine's signature, the scheduler's, the CLIs' flags, the disaggregated workers' kwargs)
# refers to it. `DEFAULT_BLOCK_SIZE` is the block size's one literal (the cache config's too).
ENGINE_DEFAULTS = ("max_num_seqs", "max_num_batched_tokens", "block_size")


def _knob(name: str | None) -> str | None:
    """The engine default a name stands for: the knob itself, its flag (`--max-num-seqs`) or its
    constant (`DEFAULT_BLOCK_SIZE`)."""
    if not isinstance(name, str):
        return None
    name = name.lstrip("-").replace("-", "_").lower().removeprefix("default_")
    return name if name in ENGINE_DEFAULTS else None


def _literal(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def _default_literals(tree: ast.AST) -> list[tuple[str, int]]:
    """(knob, line) for each literal that sets an engine default: a parameter's default, a keyword
    argument, a dict entry, an assignment or class field (`field(default=...)` or a helper call's
    first argument too), or an argparse flag's `default=`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            found += [(_knob(arg.arg), d.lineno) for arg, d in pairs if _knob(arg.arg) and _literal(d)]
        elif isinstance(node, ast.Call):
            found += [(_knob(k.arg), k.value.lineno) for k in node.keywords if _knob(k.arg) and _literal(k.value)]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                names = [a.value for a in node.args if isinstance(a, ast.Constant)]
                names += [k.value.value for k in node.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)]
                knob = next((_knob(n) for n in names if _knob(n)), None)
                found += [(knob, k.value.lineno) for k in node.keywords
                          if knob and k.arg == "default" and _literal(k.value)]
        elif isinstance(node, ast.Dict):
            found += [(_knob(k.value), v.lineno) for k, v in zip(node.keys, node.values)
                      if isinstance(k, ast.Constant) and _knob(k.value) and _literal(v)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            if isinstance(value, ast.Call):  # a dataclass field: `field(default=64)`, or a helper's `_knob(64, ...)`
                first = value.args[0] if value.args else None
                value = next((k.value for k in value.keywords if k.arg == "default"), first)
            for t in targets:
                name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
                if _knob(name) and value is not None and _literal(value):
                    found.append((_knob(name), node.lineno))
    return found


@pytest.mark.parametrize("knob", ENGINE_DEFAULTS)
def test_each_engine_default_is_a_literal_in_one_place(knob):
    sites = [f"{path.relative_to(PACKAGE.parent)}:{line}" for name, path in _modules().items()
             for k, line in _default_literals(ast.parse(path.read_text())) if k == knob]
    assert len(sites) == 1 and sites[0].startswith("hf_paged/config.py:"), sites


@pytest.mark.parametrize("src", [
    "def f(max_num_seqs=64): pass", "def f(*, block_size: int = 16): pass", "Engine(m, max_num_batched_tokens=2048)",
    "p.add_argument('--block-size', type=int, default=16)", "kw = {'block_size': 16}", "DEFAULT_BLOCK_SIZE = 16",
    "class C:\n    max_num_seqs: int = field(default=64)", "class C:\n    block_size: int = _knob(16, 'help')",
])
def test_the_default_finder_finds(src):
    assert _default_literals(ast.parse(src))


@pytest.mark.parametrize("src", [
    "def f(max_num_seqs=EngineConfig.max_num_seqs): pass", "Engine(m, block_size=args.block_size)",
    "p.add_argument('--max-num-seqs', type=int, default=DEFAULTS.max_num_seqs)", "def f(num_blocks=16): pass",
])
def test_the_default_finder_allows(src):
    assert not _default_literals(ast.parse(src))


# An engine's parts (its scheduler, KV cache, model runner) and an `AsyncEngine`'s engine are the
# engine package's own: everyone else goes through `Engine`'s public methods and properties.
ENGINE_PARTS = {"scheduler", "cache", "runner", "engine"}


def _part_reach_ins(tree: ast.AST) -> list[tuple[str, int]]:
    """(`engine.scheduler`, line) for each use of an engine's part: `<...>.engine.<part>`,
    `<...>_engine.<part>` or `engine.<part>` read, written or called into."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name.lstrip("_") == "engine" or name.endswith("_engine"):
                bad.append((ast.unparse(node), node.lineno))
    return bad


def test_nothing_outside_the_engine_reaches_into_its_parts():
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} {expr}" for name, path in _modules().items()
           if _room(name) != "engine"
           for expr, line in _part_reach_ins(ast.parse(path.read_text()))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("src", [
    "engine.scheduler.max_num_seqs = 4", "engine.cache.grow_to(8)", "n = self.engine.cache.pool.num_used_blocks",
    "x = server.engine.engine.metrics()", "slot.engine.runner.run()", "self._engine.scheduler.has_unfinished",
])
def test_the_reach_in_finder_finds(src):
    assert _part_reach_ins(ast.parse(src))


@pytest.mark.parametrize("src", [
    "engine.resize(max_num_seqs=4)", "n = engine.num_used_kv_blocks", "ref.cache.layers", "self.cache.pool",
    "slot.engine = None", "self.engine.metrics()",
])
def test_the_reach_in_finder_allows(src):
    assert not _part_reach_ins(ast.parse(src))


def test_no_script_shadows_an_installed_package():
    """`python benchmarks/x.py` puts `benchmarks/` first on `sys.path`: a script named like an installed
    package hides it from everything imported after (`benchmarks/kernels.py` hid HF's `kernels`, which
    transformers 5.25 imports with every model)."""
    import pkgutil
    import site

    root = PACKAGE.parent
    installed = {m.name for m in pkgutil.iter_modules(site.getsitepackages())} | set(sys.stdlib_module_names)
    clashes = [f"{path.relative_to(root)} hides the installed `{path.stem}`"
               for folder in ("benchmarks", "examples", "scripts") for path in (root / folder).glob("*.py")
               if path.stem in installed]
    assert not clashes, "\n".join(clashes)
