"""The ways ``kvtrace capture`` gets its hook into an engine (``--method``), best first: the one
table that ``capture.attach`` follows and the CLI offers. It lives outside ``capture/`` so that
``kvtrace --help`` imports no capture code."""

# kvtrace's own injector, then the debuggers: auto takes the first that passes its canary
# (least stop first).
INJECTORS = ("ptrace", "gdb", "lldb")
METHODS = ("auto", "plugin", "remote-exec", *INJECTORS)
METHOD_HELP = ("How to get kvtrace's hook into the engine: auto takes the plugin, then "
               "remote-exec (Python 3.14), then the first of kvtrace's own injector (ptrace), "
               "gdb and lldb that passes its canary.")
