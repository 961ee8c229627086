//! A tiny PNG heat-map renderer for attention weights (no plotting dependency).

use std::path::Path;

/// An RGB canvas.
pub struct Canvas {
    w: usize,
    h: usize,
    px: Vec<[u8; 3]>,
}

impl Canvas {
    pub fn new(w: usize, h: usize) -> Self {
        Self { w, h, px: vec![[255, 255, 255]; w * h] }
    }

    pub fn rect(&mut self, x: usize, y: usize, w: usize, h: usize, c: [u8; 3]) {
        for yy in y..(y + h).min(self.h) {
            for xx in x..(x + w).min(self.w) {
                self.px[yy * self.w + xx] = c;
            }
        }
    }

    /// Draws ASCII text with the 8x8 public-domain font, scaled by `scale`.
    pub fn text(&mut self, x: usize, y: usize, s: &str, scale: usize, c: [u8; 3]) {
        for (i, ch) in s.chars().enumerate() {
            let glyph = font8x8::legacy::BASIC_LEGACY[(ch as usize).min(127)];
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits & (1 << col) != 0 {
                        self.rect(x + (i * 8 + col) * scale, y + row * scale, scale, scale, c);
                    }
                }
            }
        }
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let file = std::fs::File::create(path)?;
        let mut enc =
            png::Encoder::new(std::io::BufWriter::new(file), self.w as u32, self.h as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut writer = enc.write_header().map_err(std::io::Error::other)?;
        let data: Vec<u8> = self.px.iter().flatten().copied().collect();
        writer.write_image_data(&data).map_err(std::io::Error::other)?;
        Ok(())
    }
}

/// Viridis-like colour map on `[0, 1]` (piecewise linear through five anchors).
pub fn colour(v: f32) -> [u8; 3] {
    const ANCHORS: [[f32; 3]; 5] =
        [[68., 1., 84.], [59., 82., 139.], [33., 145., 140.], [94., 201., 98.], [253., 231., 37.]];
    let v = if v.is_finite() { v.clamp(0.0, 1.0) } else { 0.0 } * 4.0;
    let i = (v.floor() as usize).min(3);
    let t = v - i as f32;
    let (a, b) = (ANCHORS[i], ANCHORS[i + 1]);
    [0, 1, 2].map(|k| (a[k] + (b[k] - a[k]) * t).round() as u8)
}

/// One heat map: a title and a `rows x cols` matrix with tick labels.
pub struct Panel {
    pub title: String,
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<f32>,
    pub row_labels: Vec<String>,
    pub col_labels: Vec<String>,
}

/// Lays panels out in a grid (`per_row` per row) under a caption and writes a PNG.
pub fn save_grid(
    panels: &[Panel],
    per_row: usize,
    caption: &str,
    path: &Path,
) -> std::io::Result<()> {
    let cell = 22;
    let (rows, cols) = panels.first().map(|p| (p.rows, p.cols)).unwrap_or((1, 1));
    let margin_left = 28;
    let margin_top = 44;
    let pw = margin_left + cols * cell + 24;
    let ph = margin_top + rows * cell + 24;
    let grid_rows = panels.len().div_ceil(per_row.max(1));
    let header = 56;
    let width = (pw * per_row.max(1)).max(caption.len() * 16 + 24);
    let mut c = Canvas::new(width, header + ph * grid_rows + 8);
    c.text(12, 14, caption, 2, [20, 20, 20]);
    for (i, p) in panels.iter().enumerate() {
        let ox = (i % per_row) * pw;
        let oy = header + (i / per_row) * ph;
        c.text(ox + margin_left, oy + 4, &p.title, 2, [20, 20, 20]);
        for (j, l) in p.col_labels.iter().enumerate() {
            c.text(ox + margin_left + j * cell + 7, oy + margin_top - 12, l, 1, [90, 90, 90]);
        }
        for (r, l) in p.row_labels.iter().enumerate() {
            c.text(ox + 10, oy + margin_top + r * cell + 7, l, 1, [90, 90, 90]);
        }
        for r in 0..p.rows {
            for k in 0..p.cols {
                let v = p.values[r * p.cols + k];
                c.rect(
                    ox + margin_left + k * cell,
                    oy + margin_top + r * cell,
                    cell - 1,
                    cell - 1,
                    colour(v),
                );
            }
        }
    }
    c.save(path)
}
