"""The package layering written in README.md holds in the code: no import
goes from a lower layer to a higher one (or sideways), and the learner
(`cmimem_jax.rl`) loads nothing of memories, CMI or evaluation."""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cmimem_jax"


def readme_layers() -> dict[str, int]:
  """`{unit: layer}` from README's package table (unit: the name under
  `cmimem_jax`, e.g. "rl" or "train")."""
  layers = {}
  for line in (ROOT / "README.md").read_text().splitlines():
    row = re.match(r"\|\s*(\d+)\s*\|([^|]+)\|", line)
    if row:
      for name in re.findall(r"`([\w.]+)`", row.group(2)):
        layers[name.removeprefix("cmimem_jax.")] = int(row.group(1))
  return layers


def unit_of(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if parts[0] == "cmimem_jax" and len(parts) > 1 else None


def all_imports(path: pathlib.Path, module: str) -> set[str]:
  """Every module `path` (module `module`) imports, at any depth
  (function-level imports included), relative imports resolved."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split(".")[:-node.level]
        if path.name == "__init__.py":
          base = module.split(".")[:len(module.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
      else:
        target = node.module
      found.add(target)
      # `from cmimem_jax import cmi` imports the module `cmimem_jax.cmi`.
      found.update(f"{target}.{a.name}" for a in node.names)
  return found


def imports_of(path: pathlib.Path, module: str) -> set[str]:
  """Every `cmimem_jax` module `path` (module `module`) imports."""
  return {m for m in all_imports(path, module)
          if m.split(".")[0] == "cmimem_jax"}


def modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def test_readme_table_names_every_package():
  units = {unit_of(m) for m in modules()} - {None}
  assert units == set(readme_layers()), (
      "README's package table and the packages differ: "
      f"{sorted(units ^ set(readme_layers()))}")


def test_no_import_goes_up_or_sideways():
  layers = readme_layers()
  violations = []
  for module, path in modules().items():
    own = unit_of(module)
    if own is None:
      continue
    for target in imports_of(path, module):
      other = unit_of(target)
      if other is None or other == own:
        continue
      if layers[other] >= layers[own]:
        violations.append(f"{module} (layer {layers[own]}) imports {target} "
                          f"(layer {layers[other]})")
  assert not violations, "\n".join(violations)


def test_the_checker_sees_an_upward_import(tmp_path):
  # The walker must find function-level and relative imports; otherwise
  # the test above could pass on a tree full of upward arrows.
  path = tmp_path / "mod.py"
  path.write_text("def f():\n  from cmimem_jax.task import loop\n"
                  "from .. import cmi\nimport cmimem_jax.evaluation.run\n")
  units = {unit_of(m) for m in imports_of(path, "cmimem_jax.rl.mod")}
  assert units == {"task", "cmi", "evaluation", None}


def test_learner_imports_nothing_of_the_task():
  code = ("import json, sys; import cmimem_jax.rl; print(json.dumps("
          "sorted(m for m in sys.modules if m.startswith('cmimem_jax'))))")
  out = subprocess.run([sys.executable, "-c", code], check=True,
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  loaded = json.loads(out.stdout)
  assert "cmimem_jax.rl.trainer" in loaded
  forbidden = [m for m in loaded if unit_of(m) in (
      "memory", "cmi", "evaluation", "task")]
  assert not forbidden, forbidden


def import_graph() -> dict[str, set[str]]:
  """`{module: the cmimem_jax modules it imports}` (any depth, type-checking
  imports included: a circle there is still a circle of the design)."""
  found = modules()
  return {module: {t for t in imports_of(path, module)
                   if t in found and t != module}
          for module, path in found.items()}


def import_circle(graph: dict[str, set[str]]) -> list[str]:
  """One circle of `graph` (`[a, b, ..., a]`), or [] when it has none."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done.
  path: list[str] = []

  def visit(module: str) -> list[str]:
    state[module] = 1
    path.append(module)
    for target in sorted(graph[module]):
      if state.get(target) == 1:
        return path[path.index(target):] + [target]
      if target not in state and (circle := visit(target)):
        return circle
    path.pop()
    state[module] = 2
    return []

  for module in sorted(graph):
    if module not in state and (circle := visit(module)):
      return circle
  return []


def test_no_import_circle():
  circle = import_circle(import_graph())
  assert not circle, " -> ".join(circle)


def test_the_circle_finder_sees_a_circle():
  assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
      "a", "b", "c", "a"]
  assert import_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_estimator_reads_no_bank_storage():
  # The CMI estimator takes what conditioning needs from the bank's own
  # methods (`MemoryBank.conditioning_pool`), never its stores.
  readers = [f"{path.relative_to(ROOT)}:{node.lineno}"
             for path in (PACKAGE / "cmi").rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "stores"]
  assert not readers, readers


TOOLS = ROOT / "tools"


def tool_imports_of_tools(path: pathlib.Path, module: str) -> list[str]:
  """The tools `path` (module `module`) imports: `tools.x` (relative
  imports resolved), or a file of `tools/` by its bare name (what a
  `sys.path` edit allowed)."""
  siblings = {p.stem for p in TOOLS.glob("*.py")} - {"__init__"}
  return sorted(m for m in all_imports(path, module)
                if m.split(".")[0] in {"tools", *siblings})


def test_a_tool_imports_the_library_never_another_tool():
  tools = sorted(p for p in TOOLS.glob("*.py") if p.name != "__init__.py")
  assert len(tools) >= 10, tools
  violations = {p.name: tool_imports_of_tools(p, f"tools.{p.stem}")
                for p in tools}
  assert not {k: v for k, v in violations.items() if v}, violations
  # The library never imports a tool (it sits below them).
  library = {module: tool_imports_of_tools(path, module)
             for module, path in modules().items()}
  assert not {k: v for k, v in library.items() if v}, library


def sys_path_edits(path: pathlib.Path) -> list[int]:
  """Lines of `path` that change `sys.path` (a call of one of its
  methods, or an assignment to it or an item of it)."""
  def is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")
  lines = []
  for node in ast.walk(ast.parse(path.read_text())):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and is_sys_path(node.func.value)):
      lines.append(node.lineno)
    elif isinstance(node, (ast.Assign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [
          node.target]
      for target in targets:
        if is_sys_path(target) or (isinstance(target, ast.Subscript)
                                   and is_sys_path(target.value)):
          lines.append(node.lineno)
  return sorted(lines)


def test_nothing_edits_sys_path():
  """Tools run as `python -m tools.NAME` and tests from the repository
  root (pytest.ini's `pythonpath`): every import resolves without an
  edit of `sys.path`."""
  files = [*TOOLS.rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
           *PACKAGE.rglob("*.py"), *(ROOT / "configs").rglob("*.py")]
  edits = {str(p.relative_to(ROOT)): sys_path_edits(p) for p in files}
  assert not {k: v for k, v in edits.items() if v}, edits


def test_the_checkers_see_a_tool_import_and_a_sys_path_edit(tmp_path):
  path = tmp_path / "tool.py"
  path.write_text(
      "import sys\nfrom cmimem_jax import config\nimport numpy\n"
      "def f():\n  from tools import plan\n  import reproduce\n"
      "  sys.path.insert(0, '..')\n  sys.path += ['x']\n"
      "from . import bench\nsys.path[0] = 'y'\n")
  assert tool_imports_of_tools(path, "tools.tool") == [
      "reproduce", "tools", "tools.bench", "tools.plan"]
  assert sys_path_edits(path) == [7, 8, 10]
