"""The head's stderr carries one line when a run fails: asyncio's report of a timeout that no
one waited for (left by Dask's client when it is torn down mid-wait) is dropped, while any
other exception asyncio reports still shows."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.e2e.test_cli import ROOT

_LEAVE_UNWAITED = textwrap.dedent("""
    import asyncio, gc
    from astraflow.runtime.launch import head_logging

    head_logging()
    head_logging()  # twice: one filter

    async def main():
        for exc in (TimeoutError("Timeout"), RuntimeError("a real failure")):
            asyncio.get_running_loop().create_future().set_exception(exc)
            gc.collect()

    asyncio.run(main())
""")


def test_an_unwaited_timeout_is_not_reported_and_other_exceptions_are():
    done = subprocess.run([sys.executable, "-c", _LEAVE_UNWAITED], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "TimeoutError" not in done.stderr, done.stderr
    assert done.stderr.count("Future exception was never retrieved") == 1, done.stderr
    assert "RuntimeError: a real failure" in done.stderr, done.stderr
