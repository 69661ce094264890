"""Java and Go contexts where the image has no Jupyter kernel for them: execd drives the languages'
own tools in the image — a JDK's JShell (state kept, a thrown exception an `EvalException` as the
reference's Java kernel names it) and Go's `go build` per run (a compile error a
`CompilationError`) — through the official `opensandbox-code-interpreter` SDK, with the reference's
own cells. The `host` image brings the host's Debian `openjdk-17-jdk-headless` and `golang-go`
(scripts/install-deps installs both) and no Java or Go kernel. The engines are execd's, the same on
every runtime; the `host` image is in Warren's image store: once, on the first runtime whose images
come from there (imageSource "store")."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

import warren_e2e as W
from conftest import SandboxFactory


@pytest.fixture(scope="module")
def ci(server):
    from code_interpreter import CodeInterpreterSync
    server.run_once("execd's engines are the same on every runtime; the host image is in Warren's image store",
                    imageSource="store")
    f = SandboxFactory(server)
    sbx = f("host")
    # The SDK waits for the Jupyter port: execd opens it for a language's own tools too.
    yield CodeInterpreterSync.create(sbx, ready_timeout=timedelta(seconds=60))
    f.cleanup()


def text(messages) -> str:
    return "".join(m.text for m in messages)


def test_java_through_jshell_keeps_state_answers_and_fails_as_the_reference(ci):
    from code_interpreter.models.code import SupportedLanguage
    java = ci.codes.create_context(SupportedLanguage.JAVA)
    assert java.language == "java"
    first = ci.codes.run(
        'System.out.println("Hello from Java!");\n'
        "int result = 2 + 2;\n"
        'System.out.println("2 + 2 = " + result);\n'
        "result",
        context=java,
    )
    assert first.error is None, first.error
    assert [r.text for r in first.result] == ["4"]
    out = text(first.logs.stdout)
    assert "Hello from Java!" in out and "2 + 2 = 4" in out, out
    # State stays: the next run reads the variable and imports what it needs.
    again = ci.codes.run(
        "import java.util.*;\n"
        "List<Integer> numbers = Arrays.asList(1, 2, 3, 4, 5);\n"
        "int sum = numbers.stream().mapToInt(Integer::intValue).sum();\n"
        'System.out.println("Sum: " + sum);\n'
        "result",
        context=java,
    )
    assert again.error is None and [r.text for r in again.result] == ["4"], again
    assert "Sum: 15" in text(again.logs.stdout)
    # A thrown exception is an error, named as the reference's kernel names it, with its class.
    boom = ci.codes.run("int x = 10 / 0; // This will cause ArithmeticException", context=java)
    assert boom.error is not None and boom.error.name == "EvalException", boom.error
    assert "ArithmeticException" in boom.error.value
    # A compile error is an error too, with the compiler's words.
    bad = ci.codes.run("undefinedMethod();", context=java)
    assert bad.error is not None and bad.error.name == "CompilationException", bad.error
    assert "cannot find symbol" in bad.error.value
    # Another context has state of its own.
    other = ci.codes.create_context(SupportedLanguage.JAVA)
    alone = ci.codes.run("result", context=other)
    assert alone.error is not None, alone


def test_a_java_run_is_interrupted_and_its_context_lives_on(ci):
    from code_interpreter.models.code import SupportedLanguage
    from opensandbox.models.execd_sync import ExecutionHandlersSync
    java = ci.codes.create_context(SupportedLanguage.JAVA)
    ci.codes.run("int kept = 7;", context=java)
    inits = []
    handlers = ExecutionHandlersSync(on_init=lambda i: inits.append(i.id))
    result = {}

    def spin():
        result["run"] = ci.codes.run("long n = 0; while (true) { n++; }", context=java, handlers=handlers)

    t = threading.Thread(target=spin)
    t.start()
    W.wait_until(lambda: inits, 30, message="the run's init event")
    time.sleep(1)
    ci.codes.interrupt(inits[0])
    t.join(30)
    assert not t.is_alive(), "the interrupted run never ended"
    assert result["run"].error is not None and result["run"].error.name == "KeyboardInterrupt"
    after = ci.codes.run("kept", context=java)
    assert after.error is None and [r.text for r in after.result] == ["7"], after


def test_go_builds_and_runs_each_cell(ci):
    from code_interpreter.models.code import SupportedLanguage
    go = ci.codes.create_context(SupportedLanguage.GO)
    assert go.language == "go"
    hello = ci.codes.run(
        'package main\nimport "fmt"\nfunc main() {\n    fmt.Print("Hello from Go!")\n'
        '    result := 2 + 2\n    fmt.Print("2 + 2 =", result)\n}',
        context=go,
    )
    assert hello.error is None, hello.error
    assert text(hello.logs.stdout) == "Hello from Go!2 + 2 =4"
    data = ci.codes.run(
        'package main\nimport "fmt"\nfunc calculate(numbers []int) int {\n    sum := 0\n'
        "    for _, num := range numbers {\n        sum += num\n    }\n    return sum\n}\n"
        'func main() {\n    numbers := []int{1, 2, 3, 4, 5}\n    fmt.Print("Sum:", calculate(numbers))\n}',
        context=go,
    )
    assert data.error is None and text(data.logs.stdout) == "Sum:15", data
    # A cell without a package clause is package main.
    short = ci.codes.run('import "os"\nfunc main() { os.Stdout.WriteString("short") }', context=go)
    assert short.error is None and text(short.logs.stdout) == "short", short
    # A compile error, with the compiler's words; a panic, with its output and exit status.
    bad = ci.codes.run("package main\nfunc main() {\n    undeclaredVariable++\n}", context=go)
    assert bad.error is not None and bad.error.name == "CompilationError", bad.error
    assert "undefined: undeclaredVariable" in bad.error.value
    panic = ci.codes.run('package main\nfunc main() { panic("no") }', context=go)
    assert panic.error is not None and panic.error.name == "ExitError", panic.error
    assert "panic: no" in text(panic.logs.stderr)
    # Off the network: an import from outside the standard library does not download anything.
    fetch = ci.codes.run('package main\nimport _ "example.com/nothing"\nfunc main() {}', context=go)
    assert fetch.error is not None and fetch.error.name == "CompilationError", fetch.error


def test_a_go_run_is_interrupted(ci):
    from code_interpreter.models.code import SupportedLanguage
    from opensandbox.models.execd_sync import ExecutionHandlersSync
    go = ci.codes.create_context(SupportedLanguage.GO)
    inits = []
    handlers = ExecutionHandlersSync(on_init=lambda i: inits.append(i.id))
    result = {}

    def spin():
        result["run"] = ci.codes.run(
            'package main\nimport ("fmt"; "time")\nfunc main() { for i := 0; ; i++ { fmt.Println(i); time.Sleep(100 * time.Millisecond) } }',
            context=go, handlers=handlers)

    t = threading.Thread(target=spin)
    t.start()
    W.wait_until(lambda: inits, 60, message="the run's init event")
    W.wait_until(lambda: ci.sandbox.commands.run("pgrep -f 'warren-kernels/go-.*/[p]rogram' || true")
                 .logs.stdout, 60, message="the program to run")
    ci.codes.interrupt(inits[0])
    t.join(30)
    assert not t.is_alive(), "the interrupted run never ended"
    assert result["run"].error is not None and result["run"].error.name == "KeyboardInterrupt"
    code, out, _ = W.sh(ci.sandbox, "pgrep -f 'warren-kernels/go-.*/[p]rogram' || echo none")
    assert out.strip() == "none", "the program outlived its interrupt"
