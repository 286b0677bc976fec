"""The GPU suite, checked on any machine: tests/test_gpu.py runs only where a GPU is, so what it would miss shows here
first. Every name its embedded scripts and expected lines use must exist in the code, and every flag and value of
every chapter must have a CUDA twin (tests/support/cuda_twins.py) or a GPU test named for it."""
import ast
import importlib
import inspect
import re
import textwrap

from support import REPO, cuda_twins
from support.run import run_forked

GPU_SUITE = REPO / "tests" / "test_gpu.py"


def _project_module(name):
    """The project's module of that name (common.X or a chapter at the root), imported; None for anything else."""
    top = name.split(".")[0]
    if top != "common" and not (REPO / f"{top}.py").exists():
        return None
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def _missing_names(script):
    """What a script imports from the project, or reads from a project module it imported, that the code lacks."""
    missing, modules = [], {}
    for n in ast.walk(script):
        if isinstance(n, ast.Import):
            modules.update({a.asname or a.name: _project_module(a.name) for a in n.names})
        elif isinstance(n, ast.ImportFrom) and _project_module(n.module or ""):
            for a in n.names:
                submodule = _project_module(f"{n.module}.{a.name}")
                if submodule:
                    modules[a.asname or a.name] = submodule
                elif not hasattr(_project_module(n.module), a.name):
                    missing.append(f"from {n.module} import {a.name}")
    for n in ast.walk(script):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and modules.get(n.value.id) \
                and not hasattr(modules[n.value.id], n.attr):
            missing.append(f"{n.value.id}.{n.attr}")
    return missing


def test_the_gpu_suite_names_what_the_code_has():
    """tests/test_gpu.py runs only where a GPU is, so a name it uses that the code no longer has shows there first
    (twice so far: engine._sync after its rename, and 'common.engine DataParallel' after the class moved to chapter 2).
    Here, on any machine: every import and module attribute its embedded scripts use, and every "module Class" its
    expected lines name, must exist in the code."""
    source = GPU_SUITE.read_text()
    texts = [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    missing, scripts = [], 0
    for text in texts:
        try:
            script = ast.parse(textwrap.dedent(text))
        except SyntaxError as e:
            script = None
            if re.search(r"^\s*(import|from) \w", text, re.M):  # a script that would not even start on the GPU
                missing.append(f"{text.strip().splitlines()[0]}...: {e}")
        if script is not None and any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(script)):
            scripts += 1
            missing += _missing_names(script)
        for module, name in re.findall(r"\b((?:common\.)?[a-z_]+) ([A-Z]\w+)\b", text):
            if _project_module(module) and not hasattr(_project_module(module), name):
                missing.append(f"'{module} {name}'")
    assert scripts >= 3 and missing == [], missing


def _flags_and_values(help_text):
    """{--flag: [its values]} from a chapter's --help: a flag's choices ({a,b}), or [] for a free value or a switch."""
    found = re.findall(r"^  (--[a-z-]+)(?: \{([^}]*)\})?", help_text, re.M)
    return {flag: choices.split(",") if choices else [] for flag, choices in found if flag != "--help"}


def test_every_flag_has_a_cuda_twin():
    """Every flag of every chapter (from its --help), and every value of a flag with choices (--comm-hook's from its
    refusal), runs on CUDA in tests/test_gpu.py: in a twin (TWINS), in every twin (SLICE, chapter_command), or in the
    tests named for it. Each chapter has a twin, and every chapter that takes --snapshot resumes one there (or refuses
    it there). A flag added without its GPU twin turns this test red."""
    gpu_tests = {n.name: n for n in ast.parse(GPU_SUITE.read_text()).body if isinstance(n, ast.FunctionDef)}
    helps = run_forked([(chapter, ["--help"], {}) for chapter in cuda_twins.CHAPTER_NAMES])
    hook = run_forked([("ddp_comm_hooks.py", ["--comm-hook", "?"], {})])[0].stderr
    listed = hook.split("must be ", 1)[1].split(" (", 1)[0]  # none, bf16, fp16, powersgd[:RANK[:START]] or localsgd:H...
    hook_values = [re.sub(r"[\[:].*", "", value) for value in re.split(r", | or ", listed)]
    assert "powersgd" in hook_values and "localsgd" in hook_values, hook
    in_every_run = " ".join(cuda_twins.SLICE) + inspect.getsource(cuda_twins.chapter_command)
    twins = cuda_twins.TWINS
    passed = {(flag, value) for t in twins for flag, value in zip(t.flags, [*t.flags[1:], ""])}
    missing = []
    for chapter, proc in zip(cuda_twins.CHAPTER_NAMES, helps):
        assert proc.returncode == 0, proc.stderr
        flags = _flags_and_values(proc.stdout)
        flags["--comm-hook"] = hook_values if "--comm-hook" in flags else None
        for flag, values in flags.items():
            if values is None:
                continue
            if flag in cuda_twins.COVERED_BY:
                sources = [ast.unparse(gpu_tests[name]) for name in cuda_twins.COVERED_BY[flag]]
                assert all(f'"{flag}"' in source or f"'{flag}'" in source for source in sources), flag
            elif flag in cuda_twins.PASSED_BY_EVERY_RUN:
                assert flag in in_every_run, flag
            elif not values:
                missing += [flag] * (not any(f == flag for f, _ in passed))
            else:  # each value: the default runs in any twin without the flag
                about = re.split(r"\n  (?=-)", proc.stdout.split(f"\n  {flag}", 1)[1])[0]  # its help, to the next
                default = re.findall(r"\(default (\S+?)\)", " ".join(about.split()))[-1:]  # argparse's, last
                missing += [f"{flag} {v}" for v in values if not any(f == flag and x.split(":")[0] == v
                                                                    for f, x in passed) and [v] != default]
        if chapter in cuda_twins.SAME_MODEL_TESTS:  # a chapter that needs more than chapter_command (a lighthouse)
            assert cuda_twins.SAME_MODEL_TESTS[chapter] in gpu_tests, chapter
        elif chapter != "single_gpu.py" and not any(t.chapter == chapter and t.check == "same" for t in twins):
            missing.append(f"{chapter}: a twin that trains chapter 1's model")
        if "--snapshot" in flags and not any(t.chapter == chapter and (t.check == "resume" or t.check == "refused"
                                                                       and "--snapshot" in t.flags) for t in twins):
            missing.append(f"{chapter} --snapshot: a resumed twin")
    assert sorted(set(missing)) == [], sorted(set(missing))
