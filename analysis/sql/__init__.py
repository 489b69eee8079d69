"""The SQL as written out: every statement `phaselens schema apply` runs (`ddl`), the checked-in
renderings `*.sql` beside this module (`sql_files`), and the SQL cookbook (`cookbook`)."""

from phaselens.analysis.sql import ddl, sql_files
from phaselens.analysis.sql.ddl import all_statements

__all__ = ["all_statements", "ddl", "sql_files"]
