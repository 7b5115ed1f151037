"""Downstream evaluation of a run (`populora eval`): code generation, code reasoning, math.

`runner` drives it; `codegen`, `codeio` and `mathbench` each hold their benchmarks'
loaders, prompts, answer extraction and scoring (documented in their docstrings);
`metrics` turns verdicts into pass@k / accuracy rows and the eval.md table; `command` is the
CLI. Nothing is imported here, so `populora --help` stays light.
"""
