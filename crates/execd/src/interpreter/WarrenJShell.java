import java.io.*;
import java.nio.charset.StandardCharsets;
import java.util.*;
import jdk.jshell.*;

/**
 * Warren's Java code context where the image has a JDK but no Jupyter kernel (execd's
 * `interpreter::jshell` starts it with `java WarrenJShell.java`). One JShell keeps the context's
 * state; each cell is split into snippets as JShell's own REPL splits them and evaluated in turn.
 *
 * Wire (stdout, one line per event, payload in base64): `O` output, `E` error output, `R` the
 * value of a cell that ends in an expression, `X` an error ("name\nvalue\ntraceback..."), `D` the
 * cell is done (and once at start: ready). Input: the cell's byte length on a line, then its bytes.
 * SIGINT stops the running snippet.
 */
public class WarrenJShell {
    static volatile boolean stopped;

    static final PrintStream WIRE = new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);
    static final Base64.Encoder B64 = Base64.getEncoder();

    static synchronized void emit(char kind, String text) {
        WIRE.print(kind);
        WIRE.print(' ');
        WIRE.print(B64.encodeToString(text.getBytes(StandardCharsets.UTF_8)));
        WIRE.print('\n');
        WIRE.flush();
    }

    static PrintStream stream(char kind) {
        OutputStream os = new OutputStream() {
            final ByteArrayOutputStream buf = new ByteArrayOutputStream();
            @Override public synchronized void write(int b) { buf.write(b); if (b == '\n') flush(); }
            @Override public synchronized void write(byte[] b, int off, int len) { buf.write(b, off, len); flush(); }
            @Override public synchronized void flush() {
                if (buf.size() > 0) { emit(kind, buf.toString(StandardCharsets.UTF_8)); buf.reset(); }
            }
        };
        return new PrintStream(os, true, StandardCharsets.UTF_8);
    }

    public static void main(String[] args) throws Exception {
        JShell shell = JShell.builder().out(stream('O')).err(stream('E')).build();
        try {
            sun.misc.Signal.handle(new sun.misc.Signal("INT"), s -> { stopped = true; shell.stop(); });
        } catch (Throwable t) { /* no interrupt support */ }
        DataInputStream in = new DataInputStream(new BufferedInputStream(System.in));
        emit('D', "ready");
        while (true) {
            StringBuilder hb = new StringBuilder();
            int c;
            while ((c = in.read()) != -1 && c != '\n') hb.append((char) c);
            if (c == -1) return;
            int n = Integer.parseInt(hb.toString().trim());
            byte[] code = new byte[n];
            in.readFully(code);
            stopped = false;
            run(shell, new String(code, StandardCharsets.UTF_8));
            if (stopped) error("KeyboardInterrupt", "interrupted", List.of());
            emit('D', "done");
        }
    }

    static void run(JShell shell, String cell) {
        SourceCodeAnalysis sca = shell.sourceCodeAnalysis();
        String remaining = cell;
        String lastValue = null;
        while (!remaining.isBlank() && !stopped) {
            SourceCodeAnalysis.CompletionInfo info = sca.analyzeCompletion(remaining);
            String source = info.source();
            if (source == null || info.completeness() == SourceCodeAnalysis.Completeness.DEFINITELY_INCOMPLETE) {
                // the rest is incomplete: let the compiler say why
                source = remaining;
                remaining = "";
            } else {
                remaining = info.remaining();
            }
            lastValue = null;
            for (SnippetEvent ev : shell.eval(source)) {
                if (ev.causeSnippet() != null) continue;
                if (stopped) return;
                JShellException ex = ev.exception();
                if (ex != null) { fail(ex); return; }
                if (ev.status() == Snippet.Status.REJECTED) {
                    StringBuilder why = new StringBuilder();
                    shell.diagnostics(ev.snippet()).forEach(d -> {
                        if (why.length() > 0) why.append('\n');
                        why.append(d.getMessage(Locale.ROOT));
                    });
                    error("CompilationException", why.toString(), List.of(source.strip()));
                    return;
                }
                Snippet s = ev.snippet();
                boolean expr = s.kind() == Snippet.Kind.EXPRESSION
                    || (s.kind() == Snippet.Kind.VAR && s.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND);
                if (expr && ev.value() != null) lastValue = ev.value();
            }
        }
        if (lastValue != null) emit('R', lastValue);
    }

    static void fail(JShellException ex) {
        List<String> trace = new ArrayList<>();
        String name = ex.getClass().getSimpleName();
        String value = ex.getMessage() == null ? "" : ex.getMessage();
        if (ex instanceof EvalException) {
            EvalException e = (EvalException) ex;
            value = e.getExceptionClassName() + (e.getMessage() == null ? "" : ": " + e.getMessage());
        }
        trace.add(value);
        for (StackTraceElement el : ex.getStackTrace()) trace.add("    at " + el);
        error(name, value, trace);
    }

    static void error(String name, String value, List<String> trace) {
        // the value on one line: the traceback follows it, a line each
        emit('X', name + "\n" + value.replace('\n', ' ') + "\n" + String.join("\n", trace));
    }
}
