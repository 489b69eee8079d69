"""The SQL as written out: every statement `phaselens schema apply` runs (`ddl`), the checked-in
renderings `*.sql` beside this module (`sql_files`), and the SQL cookbook (`cookbook`)."""
