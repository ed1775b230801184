"""The hit-rate plot as a PNG, with the Python standard library only (zlib for the image data,
a 5x7 pixel font for the labels)."""
import struct
import zlib

FONT = {  # 5x7 glyphs, a row per string, '#' set.
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11110", "00001", "00001", "01110", "00001", "00001", "11110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
    "%": ["11001", "11010", "00010", "00100", "01000", "01011", "10011"],
    ".": ["00000", "00000", "00000", "00000", "00000", "01100", "01100"],
    ",": ["00000", "00000", "00000", "00000", "01100", "00100", "01000"],
    "-": ["00000", "00000", "00000", "11111", "00000", "00000", "00000"],
    "/": ["00001", "00010", "00010", "00100", "01000", "01000", "10000"],
    "(": ["00010", "00100", "01000", "01000", "01000", "00100", "00010"],
    ")": ["01000", "00100", "00010", "00010", "00010", "00100", "01000"],
    " ": ["00000"] * 7,
}
for ch, rows in {
    "A": ["01110", "10001", "10001", "11111", "10001", "10001", "10001"],
    "B": ["11110", "10001", "10001", "11110", "10001", "10001", "11110"],
    "C": ["01110", "10001", "10000", "10000", "10000", "10001", "01110"],
    "D": ["11110", "10001", "10001", "10001", "10001", "10001", "11110"],
    "E": ["11111", "10000", "10000", "11110", "10000", "10000", "11111"],
    "F": ["11111", "10000", "10000", "11110", "10000", "10000", "10000"],
    "G": ["01110", "10001", "10000", "10111", "10001", "10001", "01111"],
    "H": ["10001", "10001", "10001", "11111", "10001", "10001", "10001"],
    "I": ["01110", "00100", "00100", "00100", "00100", "00100", "01110"],
    "K": ["10001", "10010", "10100", "11000", "10100", "10010", "10001"],
    "L": ["10000", "10000", "10000", "10000", "10000", "10000", "11111"],
    "M": ["10001", "11011", "10101", "10101", "10001", "10001", "10001"],
    "N": ["10001", "11001", "10101", "10011", "10001", "10001", "10001"],
    "O": ["01110", "10001", "10001", "10001", "10001", "10001", "01110"],
    "P": ["11110", "10001", "10001", "11110", "10000", "10000", "10000"],
    "Q": ["01110", "10001", "10001", "10001", "10101", "10010", "01101"],
    "R": ["11110", "10001", "10001", "11110", "10100", "10010", "10001"],
    "S": ["01111", "10000", "10000", "01110", "00001", "00001", "11110"],
    "T": ["11111", "00100", "00100", "00100", "00100", "00100", "00100"],
    "U": ["10001", "10001", "10001", "10001", "10001", "10001", "01110"],
    "V": ["10001", "10001", "10001", "10001", "10001", "01010", "00100"],
    "W": ["10001", "10001", "10001", "10101", "10101", "10101", "01010"],
    "X": ["10001", "10001", "01010", "00100", "01010", "10001", "10001"],
    "Y": ["10001", "10001", "01010", "00100", "00100", "00100", "00100"],
    "Z": ["11111", "00001", "00010", "00100", "01000", "10000", "11111"],
}.items():
    FONT[ch] = rows


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def set(self, x, y, c):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(c)

    def line(self, x0, y0, x1, y1, c, width=1):
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for a in range(width):
                for b in range(width):
                    self.set(x0 + a, y0 + b, c)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x, y, s, c=(0, 0, 0), k=2):
        for ch in s.upper():
            g = FONT.get(ch, FONT[" "])
            for r, row in enumerate(g):
                for q, bit in enumerate(row):
                    if bit == "1":
                        for a in range(k):
                            for b in range(k):
                                self.set(x + q * k + a, y + r * k + b, c)
            x += 6 * k

    def png(self, path):
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(kind, data):
            c = struct.pack(">I", len(data)) + kind + data
            return c + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n")
            f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)))
            f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
            f.write(chunk(b"IEND", b""))


def series(rows, key, window):
    """Token-weighted hit rate over a sliding window of requests, in percent."""
    out = []
    for i in range(len(rows)):
        w = rows[max(0, i - window + 1):i + 1]
        p = sum(r["prompt"] for r in w)
        out.append(100.0 * sum(r[key] for r in w) / p if p else 0)
    return out


def hit_rate_png(path, rows, restarts_at, label, runs=None):
    """flashd's and the oracle's hit rate over the trace (a 50-request window). `runs` adds
    further (label, rows) lines, e.g. the same trace under a smaller quota."""
    W, H, L, R, T, Bm = 900, 440, 80, 20, 70, 60
    c = Canvas(W, H)
    pw, ph = W - L - R, H - T - Bm
    n = max(1, len(rows) - 1)
    c.line(L, T, L, T + ph, (0, 0, 0))
    c.line(L, T + ph, L + pw, T + ph, (0, 0, 0))
    for v in range(0, 101, 20):
        y = T + ph - int(ph * v / 100)
        c.line(L - 4, y, L, y, (0, 0, 0))
        c.line(L + 1, y, L + pw, y, (225, 225, 225))
        c.text(L - 50, y - 7, "%d%%" % v)
    for q in range(0, 5):
        x = L + int(pw * q / 4)
        c.text(x - 12, T + ph + 10, str(int(n * q / 4)))
    c.text(L + pw - 84, T + ph + 34, "REQUEST")
    index = {r["index"]: i for i, r in enumerate(rows)}
    for k in restarts_at:
        if k in index:
            x = L + int(pw * index[k] / n)
            for y in range(T, T + ph, 6):
                c.line(x, y, x, y + 3, (150, 150, 150))
            c.text(x + 4, T + 4, "RESTART", (120, 120, 120))
    lines = [("ORACLE", rows, "oracle", (40, 40, 40))]
    colors = [(220, 60, 40), (40, 110, 220), (40, 160, 80), (200, 140, 0), (150, 60, 200)]
    lines.append((label, rows, "cached", colors[0]))
    for i, (lab, rr) in enumerate(runs or []):
        lines.append((lab, rr, "cached", colors[(i + 1) % len(colors)]))
    for li, (lab, rr, key, col) in enumerate(lines):
        ys = series(rr, key, 50)
        prev = None
        for i, v in enumerate(ys):
            pt = (L + int(pw * i / n), T + ph - int(ph * min(v, 100) / 100))
            if prev:
                c.line(prev[0], prev[1], pt[0], pt[1], col, 2)
            prev = pt
        x, y = L + 10 + (li % 3) * 250, 10 + (li // 3) * 18
        c.line(x, y + 6, x + 24, y + 6, col, 3)
        c.text(x + 30, y, lab[:14], col)
    c.text(L, H - 18, "TOKEN-WEIGHTED HIT RATE, 50-REQUEST WINDOW", (90, 90, 90))
    c.png(path)
