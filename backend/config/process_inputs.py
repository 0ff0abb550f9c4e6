"""The rules for every value that reaches another process: host names, environment variables, interface names
and free text of the ``[cluster]`` table. One place, used by ``ClusterConfig`` (TOML, the CLI, the nodes) and
by the hostfile reader.

Why so strict: a multi-node run hands these values to programs that read them as more than data. DeepSpeed's
runner calls ``ssh <host> hostname`` (a host ``-oProxyCommand=…`` is an ssh option that runs a command) and,
for pdsh, builds one shell string per node: ``export KEY="VALUE"; cd <run dir>; python … --master_addr=ADDR``
(``multinode_runner.PDSHRunner``: the value is put in double quotes only when it holds other characters than
``[\\w@%+=:,./-]``, so ``$``, backticks, ``"`` and ``\\`` keep their shell meaning; the key and ``master_addr``
are not quoted at all). ``.deepspeed_env`` is read a line at a time, so a newline in any value writes another
variable; slurm's ``srun --export=ALL,KEY=VALUE,…`` reads ``,OTHER=…`` inside a value as another variable.

Environment names: an allow-list of the families a cluster job tunes (NCCL, Gloo, UCX, libfabric, OpenMP, MKL,
CUDA, torch), and inside them a deny-list of the names that load code or name a file (``NCCL_NET_PLUGIN``,
``CUDA_INJECTION64_PATH``, ``NCCL_DEBUG_FILE``, ``UCX_MODULE_DIR``, …). A deny-list alone cannot be complete:
``HOME`` picks the Python user site (``.pth`` files run code), ``TMPDIR`` the torch.compile cache (compiled
libraries are loaded from it), ``PDSH_SSH_ARGS_APPEND`` ssh's options, ``DS_ENV_FILE`` another env file. The
server's operator sets anything else through trusted channels: the environment ComfyUI starts in (DeepSpeed
forwards its ``NCCL*``/``PYTHON*``/``UCX*`` variables) or ``~/.deepspeed_env`` on the launching machine.

Messages name the value's problem and never quote what a file held.
"""
from __future__ import annotations

import re

from ..errors import ConfigError

# RFC 1123 labels (underscores tolerated, as some clusters use them), dot-separated; or a dotted IPv4 address.
# No leading '-', no user@, no pdsh ranges ``node[1-4]``, no IPv6 (``host:slots`` and DeepSpeed's hostfile
# cannot carry one): a name every tool reads as a host and nothing else.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
HOST = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
IPV4 = re.compile(r"^(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)$")
# NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: optional '^' (exclude) or '=' (exact), then interface names
IFNAME_LIST = re.compile(r"^[\^=]?[A-Za-z0-9][A-Za-z0-9_.:@-]{0,31}(?:,[A-Za-z0-9][A-Za-z0-9_.:@-]{0,31})*$")
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]{0,127}$")
ENV_PREFIXES = ("NCCL_", "GLOO_", "UCX_", "FI_", "OMP_", "MKL_", "CUDA_", "TORCH_", "PYTORCH_", "TOKENIZERS_")
# inside the allowed families: names that load a library, point at a file or folder, or weaken safe loading
# (whole '_'-separated words: NCCL_P2P_DIRECT_DISABLE is a switch, UCX_MODULE_DIR a folder)
ENV_DENIED_WORDS = {"PLUGIN", "PRELOAD", "LIBRARY", "LIBRARIES", "LIB", "INJECTION", "INJECTION64", "FILE", "PATH",
                    "DIR", "DIRECTORY", "FOLDER", "HOME", "CACHE", "MODULE", "MODULES", "EXTENSIONS", "ROOT", "DUMP",
                    "OUT", "TRACE", "WEIGHTS"}
# families that never pass, named in the refusal (so the message says why, not only "not allowed")
_CODE_LOADERS = (("PYTHON", "the Python interpreter's start-up (code it imports or runs)"),
                 ("LD_", "the dynamic linker (libraries loaded into every process)"),
                 ("DYLD_", "the dynamic linker"),
                 ("BASH_ENV", "a file every shell runs"), ("ENV", "a file every shell runs"),
                 ("PATH", "where programs are found"), ("IFS", "how the shell splits words"),
                 ("SHELLOPTS", "shell behaviour"), ("PS4", "shell behaviour"), ("PROMPT_COMMAND", "shell behaviour"),
                 ("HOME", "the home folder (Python's user site, ssh and DeepSpeed settings)"),
                 ("TMPDIR", "the temporary folder (torch.compile loads compiled code from it)"),
                 ("SSH_", "ssh"), ("PDSH_", "pdsh's ssh options"), ("DS_", "DeepSpeed's own settings"))
# '$', '`', '"' and '\' keep their meaning inside DeepSpeed's double quotes; "'" ends shlex/our own quoting
SHELL_ACTIVE = set("$`\"'\\")
# paths DeepSpeed puts into pdsh's command outside quotes: the characters it leaves unquoted itself, less '%'
PLAIN = re.compile(r"^[\w@+=:,./-]+$")
_SLURM_SPLIT = re.compile(r",\s*[A-Za-z_][A-Za-z0-9_]*=")
MAX_TEXT = 4096


def control_problem(value: str) -> str | None:
    """Why ``value`` cannot stand in a line of a file, a log or an argument (None: it can): too long, or a
    control or line-break character of any kind (NUL, CR, LF, U+2028, ...)."""
    if len(value) > MAX_TEXT:
        return f"is {len(value)} characters long (at most {MAX_TEXT})"
    for ch in value:
        if not ch.isprintable():
            return f"holds the control or line-break character U+{ord(ch):04X}"
    return None


def text_problem(value: str) -> str | None:
    """``control_problem``, and the characters a shell acts on inside double quotes."""
    problem = control_problem(value)
    if problem:
        return problem
    for ch in value:
        if ch in SHELL_ACTIVE:
            return f"holds {ch!r}, which a shell on the nodes would act on"
    return None


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a host name or IPv4 address (None: it is)."""
    if not host:
        return "is empty"
    if host.startswith("-"):
        return "starts with '-', which ssh and pdsh read as an option"
    if len(host) > 253:
        return "is longer than a host name can be (253)"
    if control_problem(host):
        return control_problem(host)
    if IPV4.fullmatch(host) or (HOST.fullmatch(host) and not re.fullmatch(r"[\d.]+", host)):
        return None
    return "is not a host name or IPv4 address (letters, digits, '-', '_' and '.'; no spaces, '@', brackets or " \
           "shell characters)"


def env_name_problem(name: str) -> str | None:
    """Why the node environment may not set ``name`` (None: it may)."""
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        return "is not an environment variable name (capital letters, digits and '_', a letter first)"
    for family, what in _CODE_LOADERS:
        if name == family or (name.startswith(family) and family.endswith(("_", "PYTHON"))):
            return f"would change {what}; it is never set from a run's config"
    if name.endswith("_PRELOAD") or "PRELOAD" in name:
        return "would load a library into every process; it is never set from a run's config"
    if not name.startswith(ENV_PREFIXES):
        return (f"is not among the tuning variables a run's config may set (names starting {', '.join(ENV_PREFIXES)}); "
                "set others in the environment ComfyUI or the CLI starts in, or in ~/.deepspeed_env")
    if ENV_DENIED_WORDS & set(name.split("_")):
        return ("loads code or names a file or folder; a run's config sets only switches and numbers here "
                "(set paths in the environment ComfyUI or the CLI starts in, or in ~/.deepspeed_env)")
    return None


def env_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be forwarded to every node (None: it can)."""
    problem = text_problem(value)
    if problem:
        return problem
    if "%" in value:
        return "holds '%', which pdsh replaces in the command it runs on each node (%h, %n, %u)"
    if _SLURM_SPLIT.search(value):
        return "holds ',NAME=', which srun --export reads as another variable"
    return None


def ifname_problem(value: str) -> str | None:
    if control_problem(value):
        return control_problem(value)
    if IFNAME_LIST.fullmatch(value):
        return None
    return "is not a list of network interface names, e.g. eth0 or ^docker,lo (letters, digits, '_', '.', ':', '-')"


def plain_problem(value: str) -> str | None:
    """Why ``value`` cannot stand unquoted in DeepSpeed's pdsh command (None: it can)."""
    return None if PLAIN.fullmatch(value) else "holds characters pdsh's remote shell would act on (only letters, " \
                                             "digits and @+=:,./-_ pass unquoted)"


def shown(value: str) -> str:
    """A refused value as a message may show it: escaped and short (a config's value, never a file's content)."""
    text = value.encode("ascii", "backslashreplace").decode()
    return repr(text if len(text) <= 80 else text[:77] + "...")


def refuse(problem: str | None, what: str, file, key: str) -> None:
    """``ConfigError`` naming the key, when ``problem`` says what is wrong with the value."""
    if problem:
        raise ConfigError(f"{what} {problem}", file=file, key=key)
