"""A network lab on one machine: nodes are network namespaces on a switch of their own, links are
rate-limited by the kernel (htb), jobs run in nodes with any launcher. Needs root; only addresses
of 198.18.0.0/15 are used and nothing is created in the host's network namespace."""
from ds_pipemorph.lab.lab import Lab
from ds_pipemorph.lab.net import NoPrivilege
from ds_pipemorph.lab.shape import format_rate, parse_rate
from ds_pipemorph.lab.trace import RateTrace, load_rate_trace

__all__ = ["Lab", "NoPrivilege", "RateTrace", "format_rate", "load_rate_trace", "parse_rate"]
