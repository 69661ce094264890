//! `warren-execd [--socket PATH]... [--listen ADDR] [--listen-fd FD] [--access-token-sha256 HEX] [--workdir DIR] [--jupyter-port N] [-- ENTRYPOINT ARGV...]`
//! (see `warren_execd::cli`).

fn main() {
    std::process::exit(warren_execd::cli::run(std::env::args_os()));
}
