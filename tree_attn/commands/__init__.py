"""The back ends of the commands: what ``run``, ``generate``, ``tune`` and ``simulate`` do once the
CLI has parsed their options. One subpackage (or module) per command; each resolves its options
into a spec (through :mod:`tree_attn.launch`) and runs it. Results come back as dataclasses for the
CLI to render; progress goes to callbacks or, from inside the ranks, to stderr."""
