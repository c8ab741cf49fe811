"""The `salabatch` command. Thin: each command imports what it needs (MLX included) when it runs,
so `salabatch --help` stays instant."""

from __future__ import annotations

import sys

import click

from salabatch import __version__
from salabatch.errors import SalabatchError


class _Group(click.Group):
    """Prints a SalabatchError as one line (no traceback) and exits with its code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SalabatchError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="salabatch")
def main() -> None:
    """Answer questions over long documents with MiniCPM-SALA on MLX."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool) -> None:
    """Show MLX version, device, active BLAS and measured matmul speed (about 1 s)."""
    import json

    from salabatch.engine.runtime import doctor_report

    report = doctor_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    b = report["blas"]
    for key in ("salabatch", "python", "platform", "mlx", "device"):
        click.echo(f"{key:10s} {report[key]}")
    click.echo(f"{'blas':10s} {b['kind']}, {b['threads'] or '?'} threads, {b['path'] or '-'}")
    click.echo(f"{'':10s} ({b['reason']})")
    click.echo(f"{'gemm':10s} {report['gemm_gflops']:.1f} GFLOP/s (fp32 1024x1024)")
    click.echo(f"{'decode':10s} {report['decode_gbps']:.1f} GB/s (fp32 [1,4096] @ [4096,4096]^T)")


if __name__ == "__main__":
    main()
