"""The tools around the runtime: demo, kit, gate runner, benchmarks, load generator, self-test.

Nothing under control.ops (what production runs) imports from here (import-linter contract).
"""
