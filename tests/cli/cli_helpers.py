"""What the CLI tests share: invoking the app through Typer's CliRunner and writing input files."""
import yaml
from typer.testing import CliRunner

from ds_pipemorph_cli.app import app

runner = CliRunner()


def run(*args):
    """``pipemorph ARGS...`` in this process (arguments may be paths or numbers)."""
    return runner.invoke(app, [str(a) for a in args])


def write(tmp_path, name, data):
    """``tmp_path/name`` holding ``data``: bytes and text as they are, anything else as YAML."""
    p = tmp_path / name
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p
