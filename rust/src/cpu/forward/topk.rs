//! `torch.topk(probs, k)` on the CPU, tie for tie: the chosen experts and their order as
//! PyTorch's kernel (`aten/src/ATen/native/TopKImpl.h`) leaves them, which sorts `(value,
//! index)` pairs by value alone with libstdc++'s unstable algorithms — `std::partial_sort` where
//! `k * 64 <= n`, else `std::nth_element` at `k - 1` and `std::sort` of the first `k - 1`. A bf16
//! router's logits tie often (few distinct values), so which of equal experts make the top k,
//! and in which order their terms are summed, follow those algorithms here step for step
//! (checked against torch's choices in this module's tests).

type Pair = (f32, usize);

/// `comp(x, y)`: x goes first (larger; a NaN before any number).
#[inline]
fn before(x: &Pair, y: &Pair) -> bool {
    (x.0.is_nan() && !y.0.is_nan()) || x.0 > y.0
}

/// The indexes of the `k` largest of `values`, in torch's order.
pub(super) fn topk<'p>(
    values: &[f32],
    k: usize,
    pairs: &'p mut Vec<Pair>,
) -> impl Iterator<Item = usize> + 'p {
    pairs.clear();
    pairs.extend(values.iter().copied().zip(0..));
    let k = k.min(values.len());
    if k > 0 {
        if k * 64 <= values.len() {
            partial_sort(pairs, k);
        } else {
            nth_element(pairs, k - 1);
            sort(&mut pairs[..k - 1]);
        }
    }
    pairs[..k].iter().map(|p| p.1)
}

fn lg(n: usize) -> usize {
    (usize::BITS - 1 - n.leading_zeros()) as usize
}

/// `std::nth_element` (`__introselect`).
fn nth_element(a: &mut [Pair], nth: usize) {
    let (mut first, mut last) = (0, a.len());
    if last == 0 {
        return;
    }
    let mut depth = 2 * lg(a.len());
    while last - first > 3 {
        if depth == 0 {
            heap_select(&mut a[first..last], nth + 1 - first);
            a.swap(first, nth);
            return;
        }
        depth -= 1;
        let cut = first + partition_pivot(&mut a[first..last]);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut a[first..last]);
}

/// `std::sort` (`__introsort_loop`, then `__final_insertion_sort`).
fn sort(a: &mut [Pair]) {
    if a.len() > 1 {
        introsort_loop(a, 2 * lg(a.len()));
        if a.len() > THRESHOLD {
            insertion_sort(&mut a[..THRESHOLD]);
            for i in THRESHOLD..a.len() {
                unguarded_linear_insert(a, i);
            }
        } else {
            insertion_sort(a);
        }
    }
}

/// libstdc++'s `_S_threshold`.
const THRESHOLD: usize = 16;

fn introsort_loop(a: &mut [Pair], mut depth: usize) {
    let mut last = a.len();
    while last > THRESHOLD {
        if depth == 0 {
            partial_sort(&mut a[..last], last);
            return;
        }
        depth -= 1;
        let cut = partition_pivot(&mut a[..last]);
        introsort_loop(&mut a[cut..last], depth);
        last = cut;
    }
}

/// `__unguarded_partition_pivot`: the median of three moved to the front, then the partition;
/// returns the cut.
fn partition_pivot(a: &mut [Pair]) -> usize {
    let last = a.len();
    let mid = last / 2;
    move_median_to_first(a, 0, 1, mid, last - 1);
    let (mut first, mut last) = (1, last);
    loop {
        while before(&a[first], &a[0]) {
            first += 1;
        }
        last -= 1;
        while before(&a[0], &a[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        a.swap(first, last);
        first += 1;
    }
}

fn move_median_to_first(a: &mut [Pair], result: usize, x: usize, y: usize, z: usize) {
    let pick = if before(&a[x], &a[y]) {
        if before(&a[y], &a[z]) {
            y
        } else if before(&a[x], &a[z]) {
            z
        } else {
            x
        }
    } else if before(&a[x], &a[z]) {
        x
    } else if before(&a[y], &a[z]) {
        z
    } else {
        y
    };
    a.swap(result, pick);
}

/// `std::__insertion_sort` (stable).
fn insertion_sort(a: &mut [Pair]) {
    for i in 1..a.len() {
        if before(&a[i], &a[0]) {
            a[..=i].rotate_right(1);
        } else {
            unguarded_linear_insert(a, i);
        }
    }
}

fn unguarded_linear_insert(a: &mut [Pair], mut i: usize) {
    let value = a[i];
    while before(&value, &a[i - 1]) {
        a[i] = a[i - 1];
        i -= 1;
    }
    a[i] = value;
}

/// `std::partial_sort`: the first `k` of `a` its `k` first in order (`__heap_select`, then
/// `__sort_heap`).
fn partial_sort(a: &mut [Pair], k: usize) {
    heap_select(a, k);
    for last in (1..k).rev() {
        pop_heap(a, last, last);
    }
}

fn heap_select(a: &mut [Pair], k: usize) {
    make_heap(&mut a[..k]);
    for i in k..a.len() {
        if before(&a[i], &a[0]) {
            pop_heap(a, k, i);
        }
    }
}

fn make_heap(a: &mut [Pair]) {
    let len = a.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        adjust_heap(a, parent, len, a[parent]);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// `__pop_heap(first, first + len, first + result)`.
fn pop_heap(a: &mut [Pair], len: usize, result: usize) {
    let value = a[result];
    a[result] = a[0];
    adjust_heap(a, 0, len, value);
}

fn adjust_heap(a: &mut [Pair], mut hole: usize, len: usize, value: Pair) {
    let top = hole;
    let mut second = hole;
    while len >= 1 && second < (len - 1) / 2 {
        second = 2 * (second + 1);
        if before(&a[second], &a[second - 1]) {
            second -= 1;
        }
        a[hole] = a[second];
        hole = second;
    }
    if len.is_multiple_of(2) && len >= 2 && second == (len - 2) / 2 {
        second = 2 * (second + 1);
        a[hole] = a[second - 1];
        hole = second - 1;
    }
    // `__push_heap`
    while hole > top {
        let parent = (hole - 1) / 2;
        if !before(&a[parent], &value) {
            break;
        }
        a[hole] = a[parent];
        hole = parent;
    }
    a[hole] = value;
}

#[cfg(test)]
mod tests {
    use super::topk;

    /// (k, values as digits, torch.topk's indexes) for tie-heavy rows where torch's choice or
    /// order differs from a stable sort's: nth_element (k * 64 > n; the sort of the first k - 1
    /// by insertion, and by introsort past 16) and partial_sort (k * 64 <= n).
    #[rustfmt::skip]
    const CASES: &[(usize, &str, &[usize])] = &[
            (8, "0120020120200011", &[2, 10, 8, 5, 15, 14, 7, 1]),
            (2, "00100001", &[7, 2]),
            (4, "000110010001", &[4, 7, 3, 11]),
            (8, concat!("0001111111000011111001010110011111001100111110110010010011100111", "0111110000000010110011100111110110000100100000100010111100111110"), &[104, 53, 56, 57, 58, 62, 65, 63]),
            (1, "1110200010021000110101012201021021201122200020112202102020112102", &[4]),
            (4, concat!("2220202000212202201222101211221012000022221200100101021001122202", "0000000020201021121102000201000110221011112112021222220001201022", "0201020002202002222002100221120102001012212201121012110200210022", "2012011022022120111010012110111121202201201011012110210011002210"), &[0, 1, 4, 2]),
            (2, concat!("1010010011000010001111111011011111000001011111111000001110110000", "1001110110000111010011110001011100110001101001000001001011111001"), &[2, 0]),
            (20, "21122300211001013303121113323130", &[19, 17, 16, 25, 28, 5, 30, 26, 3, 27, 4, 8, 21, 0, 29, 20, 1, 22, 23, 24]),
            (30, "0100011100000111100001110010010010010001", &[39, 7, 6, 5, 1, 13, 14, 15, 16, 21, 22, 23, 26, 29, 32, 35, 4, 30, 31, 9, 3, 33, 34, 2, 36, 37, 38, 12, 0, 18]),
            (17, "011110101010010011100100000011010010011011010000000111011101", &[41, 21, 28, 29, 31, 34, 37, 38, 40, 53, 59, 57, 56, 55, 51, 43, 1]),
    ];

    #[test]
    fn ties_are_chosen_and_ordered_as_torch_topk_does() {
        let mut pairs = Vec::new();
        for &(k, digits, want) in CASES {
            let values: Vec<f32> = digits.bytes().map(|b| f32::from(b - b'0')).collect();
            let got: Vec<usize> = topk(&values, k, &mut pairs).collect();
            assert_eq!(got, want, "k = {k}, {} values", values.len());
        }
    }
}
