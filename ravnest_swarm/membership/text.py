"""Characters no record string may hold. No network here: the dashboard's log panel imports it too."""

import re

# C0 and C1 control characters (ESC starts a terminal escape sequence, newlines break tables), line and
# paragraph separators, and the bidirectional overrides and isolates (they make one name look like another):
# no record string a terminal may show contains one, so a hostile record is dropped rather than drawn. Written
# as escapes (the body of a regex [...]): validation errors quote the pattern and must not carry the characters
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
CONTROL_CHARACTER_RE = re.compile(f"[{CONTROL_CHARACTERS}]")
