# Writes the MP4/M4A/WebM/Matroska test clips of tests/data/audio (see its README.md).
import av, numpy as np, sys, io
def gen(path, fmt, codec, seconds, rate=16000):
    out = av.open(path, 'w', format=fmt)
    s = out.add_stream(codec, rate=rate)
    s.layout = 'mono'
    n = int(seconds*rate)
    t = np.arange(n)/rate
    data = (0.2*np.sin(2*np.pi*440*t)).astype(np.float32)
    fr_len = 1024
    for i in range(0, n, fr_len):
        chunk = data[i:i+fr_len]
        fmt_in = 'fltp' if codec != 'pcm_s16le' else 's16'
        arr = chunk.reshape(1,-1)
        if fmt_in == 's16': arr = (arr*32767).astype(np.int16)
        f = av.AudioFrame.from_ndarray(arr, format=fmt_in, layout='mono')
        f.sample_rate = rate
        f.pts = i
        for p in s.encode(f): out.mux(p)
    for p in s.encode(None): out.mux(p)
    out.close()
gen(sys.argv[1]+'/clip-3s.m4a', 'ipod', 'aac', 3.0)
gen(sys.argv[1]+'/clip-3s.mp4', 'mp4', 'aac', 3.0)
gen(sys.argv[1]+'/clip-3s.webm', 'webm', 'libopus', 3.0, 48000)
gen(sys.argv[1]+'/clip-3s.mka', 'matroska', 'libopus', 3.0, 48000)
gen(sys.argv[1]+'/clip-8s.webm', 'webm', 'libopus', 8.0, 48000)
gen(sys.argv[1]+'/clip-8s.m4a', 'ipod', 'aac', 8.0)
