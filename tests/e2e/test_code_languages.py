"""The languages of the official code-interpreter image, each on a real Jupyter kernel in
the image build-test-image's code-interpreter variant makes, driven by the official
`opensandbox-code-interpreter` SDK: Python (ipykernel) and Bash (bash_kernel) as in test_code, Java
(BeakerX's kernel on Debian's OpenJDK 17, from PyPI), JavaScript and TypeScript (Deno's kernel, from
npm). Go has no kernel the project's registries carry; a Go context is refused with a message that
says so.

The kernels are the image's, not Warren's: what is checked is that execd starts each one, talks to it
(BeakerX speaks ZMTP/2.0, Deno and ipykernel ZMTP 3) and hands the SDK what it answers. Once per
session, on the first runtime: the image is 1.2 GiB and the kernels do not depend on the runtime."""

from __future__ import annotations

from datetime import timedelta

import pytest
from opensandbox.exceptions import SandboxException

import warren_e2e as W
from conftest import SandboxFactory


@pytest.fixture(scope="module")
def ci(server):
    from code_interpreter import CodeInterpreterSync
    server.run_once("the languages run once per session: the image is big and the kernels do not "
                    "depend on the runtime")
    rootfs = W.code_rootfs()
    if not (rootfs / "usr/share/jupyter/kernels/java/kernel.json").exists():
        msg = (f"code-interpreter image not found at {rootfs}: build it with `scripts/build-test-image "
               f"{rootfs} code-interpreter {W.jupyter_rootfs()}` or set WARREN_TEST_CODE_ROOTFS")
        if W.allow_skip():
            pytest.skip(msg)
        pytest.fail(msg, pytrace=False)
    server.import_image(W.CODE_IMAGE_NAME, rootfs)
    f = SandboxFactory(server)
    sbx = f(W.CODE_IMAGE_NAME)
    yield CodeInterpreterSync.create(sbx, ready_timeout=timedelta(seconds=30))
    f.cleanup()


def stdout(execution) -> str:
    return "".join(m.text for m in execution.logs.stdout)


def results(execution) -> list[str]:
    return [r.text for r in execution.result]


# language: code that prints, code that defines a value, code that reads it back, the result it
# answers (None: on stdout), code that fails (None: not checked), the error's name (None: any)
CASES = {
    "python": ("print('hello from python')", "x = 40", "x + 2", "42", "1/0", "ZeroDivisionError"),
    "bash": ("echo hello from bash", "x=40", "echo $((x + 2))", None, None, None),
    "java": ('System.out.println("hello from java");', "int x = 40;", "x + 2", "42",
             "undefinedMethod();", None),
    "javascript": ("console.log('hello from javascript')", "var x = 40", "x + 2", "42",
                   "throw new TypeError('no')", "TypeError"),
    "typescript": ("console.log('hello from typescript')", "const x: number = 40", "x + 2", "42",
                   "throw new RangeError('no')", "RangeError"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("language", list(CASES))
def test_language_keeps_state_prints_answers_and_fails(ci, language):
    hello, define, read, value, failing, error_name = CASES[language]
    ctx = ci.codes.create_context(language)
    assert ctx.language == language
    try:
        ex = ci.codes.run(hello, context=ctx)
        assert ex.error is None, ex.error
        assert stdout(ex).strip() == f"hello from {language}", ex.logs
        ex = ci.codes.run(define, context=ctx)
        assert ex.error is None, ex.error
        ex = ci.codes.run(read, context=ctx)
        assert ex.error is None, ex.error
        if value is None:      # bash answers on stdout, not with a result
            assert stdout(ex).strip() == "42", ex.logs
        else:
            assert value in results(ex), (results(ex), ex.logs)
        if failing is not None:
            ex = ci.codes.run(failing, context=ctx)
            assert ex.error is not None, (language, ex)
            if error_name:
                assert ex.error.name == error_name, ex.error
        # the context goes on after an error
        ex = ci.codes.run(read, context=ctx)
        assert ex.error is None, ex.error
    finally:
        ci.codes.delete_context(ctx.id)


def test_contexts_of_one_language_do_not_share_state(ci):
    a, b = ci.codes.create_context("typescript"), ci.codes.create_context("typescript")
    try:
        assert ci.codes.run("const only_in_a = 1", context=a).error is None
        ex = ci.codes.run("only_in_a", context=b)
        assert ex.error is not None and ex.error.name == "ReferenceError", ex.error
    finally:
        ci.codes.delete_context(a.id)
        ci.codes.delete_context(b.id)


def test_go_has_no_kernel_and_says_so(ci):
    with pytest.raises(SandboxException) as e:
        ci.codes.create_context("go")
    assert "no Jupyter kernel for language 'go'" in str(e.value), e.value


def test_console_output_trailing_the_idle_status_is_kept(ci):
    """Deno publishes console output from a task of its own, which a loaded machine can leave
    behind the kernel's idle status; a run that ended at idle lost the line (5 of 80 under load)."""
    ctx = ci.codes.create_context("typescript")
    try:
        lost = [i for i in range(30)
                if stdout(ci.codes.run(f"console.log('line {i}')", context=ctx)).strip() != f"line {i}"]
        assert lost == [], lost
    finally:
        ci.codes.delete_context(ctx.id)
