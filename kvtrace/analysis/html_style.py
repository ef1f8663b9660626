"""The stylesheet of kvtrace's HTML pages (the report's and the sweep's), so that they look
alike."""

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:80em;padding:0 1em;color:#222}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.8em}
h3{font-size:1em;margin:1em 0 .3em}
table{border-collapse:collapse;font-size:85%;margin:.4em 0}
td,th{border:1px solid #ccc;padding:2px 7px;text-align:right;white-space:nowrap}
td.text,th.text{text-align:left}th{background:#eee;cursor:pointer;user-select:none}
th[data-order=asc]::after{content:" \\25B2"}th[data-order=desc]::after{content:" \\25BC"}
code{font-size:85%;background:#f4f4f4;padding:1px 4px;word-break:break-all}
pre{background:#f8f8f8;border:1px solid #ddd;padding:.6em;font-size:80%;white-space:pre-wrap}
.verdict{border:2px solid #4f81bd;border-radius:6px;padding:.4em 1.2em 1em;background:#f5f8fc}
.verdict h2{margin-top:.6em}.advice{font-size:1.1em;font-weight:600}
.figures td,.figures th{border:none;text-align:left;padding:1px 10px 1px 0;font-size:95%}
.figures th{background:none;cursor:default;font-weight:normal;color:#555}
.warning{background:#fde9e7;border:1px solid #c0504d;padding:6px 10px}
.note{color:#444;font-size:92%}.more{color:#666;font-size:85%}
.plot{width:100%;height:380px}.wide{overflow-x:auto}nav a{margin-right:1em}
details.why{margin:.3em 0}details.why summary{cursor:pointer}
"""
